/*
 * C tests of libkvfabric_ffi, built with gcc against the committed header (plain and with
 * AddressSanitizer) and run by ffi/tests/c_abi.rs:
 *
 *   kvfabric_test errors     every error code reachable from C, in one process
 *   kvfabric_test exchange   two processes: one stores blocks and serves them, the other
 *                            loads them over the transfer engine into its own layout and
 *                            writes them back into the first one's memory with a notification
 *
 * KVF_PANIC is not reachable from C (it means a bug); the Rust unit tests cover the panic
 * boundary.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/wait.h>

#include "kvfabric.h"

static int failures = 0;

#define CHECK(cond)                                                                  \
  do {                                                                               \
    if (!(cond)) {                                                                   \
      fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond);       \
      failures++;                                                                    \
    }                                                                                \
  } while (0)

#define EXPECT(call, code)                                                           \
  do {                                                                               \
    kvf_result r_ = (call);                                                          \
    if (r_ != (code)) {                                                              \
      fprintf(stderr, "%s:%d: %s returned %u, expected %u (%s)\n", __FILE__, __LINE__, \
              #call, (unsigned)r_, (unsigned)(code), #code);                         \
      failures++;                                                                    \
    }                                                                                \
  } while (0)

#define MUST(call) EXPECT(call, KVF_OK)

/* Codes seen, so that the test can say which were exercised. */
static int seen[32];
static kvf_result note(kvf_result r) {
  if (r == KVF_OK) seen[0] = 1;
  else if (r >= 7001 && r < 7001 + 31) seen[r - 7000] = 1;
  return r;
}
#define NOTE(call, code) EXPECT(note(call), code)

enum { BT = 4, BLOCK = 4096, HALF = BLOCK / 2, NB = 6, NTOK = NB * BT + 3 };

static unsigned char pattern(int block, int i) { return (unsigned char)(block * 131 + i * 7 + 3); }

static kvf_config *config(const char *pairs[][2]) {
  kvf_config *c = NULL;
  if (kvf_config_new(&c) != KVF_OK) abort();
  for (int i = 0; pairs[i][0]; i++) {
    if (kvf_config_set(c, pairs[i][0], pairs[i][1]) != KVF_OK) {
      fprintf(stderr, "config %s=%s refused\n", pairs[i][0], pairs[i][1]);
      abort();
    }
  }
  return c;
}

static void tokens(uint32_t *t) {
  for (int i = 0; i < NTOK; i++) t[i] = 1000 + (uint32_t)i * 17;
}

/* A paged layout in one region: block b's first half at b*HALF, its second half after all
   first halves (as K and V planes). */
static void layout(uint64_t region, int blocks, kvf_segment seg[2]) {
  seg[0] = (kvf_segment){.region = region, .offset = 0, .block_stride = HALF, .bytes = HALF};
  seg[1] = (kvf_segment){.region = region, .offset = (uint64_t)blocks * HALF, .block_stride = HALF,
                         .bytes = HALF};
}

static void fill(unsigned char *buf, int blocks, const uint32_t *ids) {
  for (int b = 0; b < NB; b++)
    for (int i = 0; i < BLOCK; i++) {
      size_t at = i < HALF ? (size_t)ids[b] * HALF + (size_t)i : (size_t)blocks * HALF + (size_t)ids[b] * HALF + (size_t)(i - HALF);
      buf[at] = pattern(b, i);
    }
}

static int matches(const unsigned char *buf, int blocks, const uint32_t *ids, int n) {
  for (int b = 0; b < n; b++)
    for (int i = 0; i < BLOCK; i++) {
      size_t at = i < HALF ? (size_t)ids[b] * HALF + (size_t)i : (size_t)blocks * HALF + (size_t)ids[b] * HALF + (size_t)(i - HALF);
      if (buf[at] != pattern(b, i)) return 0;
    }
  return 1;
}

static kvf_result wait_op(kvf_op *op, uint64_t *count) {
  kvf_result r = kvf_op_wait(op, 20000, count);
  if (r != KVF_OK) {
    char text[256];
    size_t n = 0;
    kvf_op_error(op, text, sizeof text, &n);
    fprintf(stderr, "op failed (%u): %s\n", (unsigned)r, text);
  }
  return r;
}

static int test_errors(void) {
  char text[512];
  size_t len = 0;
  uint32_t tok[NTOK];
  tokens(tok);

  /* Library-wide. */
  CHECK(kvf_version() != NULL && strlen(kvf_version()) > 0);
  for (unsigned code = 7001; code <= 7014; code++) {
    MUST(kvf_result_text(code, text, sizeof text, &len));
    CHECK(len > 0 && strlen(text) == len);
  }
  NOTE(kvf_result_text(42, text, sizeof text, &len), KVF_INVALID_ARGUMENT);
  NOTE(kvf_result_text(KVF_OK, text, sizeof text, NULL), KVF_NULL_PARAMETER);
  MUST(kvf_result_text(KVF_TIMED_OUT, text, 4, &len)); /* truncated, NUL-terminated */
  CHECK(len == 3 && text[3] == 0);

  /* Config. */
  kvf_config *c = NULL;
  NOTE(kvf_config_new(NULL), KVF_NULL_PARAMETER);
  MUST(kvf_config_new(&c));
  NOTE(kvf_config_set(c, "no_such_key", "1"), KVF_INVALID_CONFIG);
  MUST(kvf_config_last_error(c, text, sizeof text, &len));
  CHECK(strstr(text, "no_such_key") != NULL);
  NOTE(kvf_config_set(c, "shm", "maybe"), KVF_INVALID_CONFIG);
  NOTE(kvf_config_set(c, "host_blocks", "-1"), KVF_INVALID_CONFIG);
  NOTE(kvf_config_set(c, "listen", "not an address"), KVF_INVALID_CONFIG);
  NOTE(kvf_config_set(NULL, "shm", "1"), KVF_NULL_PARAMETER);
  NOTE(kvf_config_set(c, NULL, "1"), KVF_NULL_PARAMETER);
  NOTE(kvf_config_set(c, "name", "\xff\xfe"), KVF_INVALID_ARGUMENT);
  kvf_config_free(NULL);
  kvf_agent_free(NULL);
  kvf_store_free(NULL);
  kvf_op_free(NULL);

  /* Agent. */
  kvf_agent *agent = NULL;
  NOTE(kvf_agent_new(c, &agent), KVF_INVALID_CONFIG); /* no secret */
  CHECK(agent == NULL);
  MUST(kvf_config_last_error(c, text, sizeof text, &len));
  CHECK(strstr(text, "secret") != NULL);
  MUST(kvf_config_set(c, "secret", "c-test-secret"));
  MUST(kvf_config_set(c, "name", "c-errors"));
  NOTE(kvf_agent_new(c, NULL), KVF_NULL_PARAMETER);
  NOTE(kvf_agent_new(NULL, &agent), KVF_NULL_PARAMETER);
  MUST(kvf_agent_new(c, &agent));
  CHECK(agent != NULL);

  /* A second agent on the first one's port cannot bind. */
  {
    unsigned char md[4096];
    size_t n = 0;
    NOTE(kvf_agent_metadata(agent, md, 8, &n), KVF_BUFFER_TOO_SMALL);
    CHECK(n > 8 && n < sizeof md);
    MUST(kvf_agent_metadata(agent, md, sizeof md, &n));
    const char *p = strstr((const char *)md, "\"tcp_addr\":\"");
    CHECK(p != NULL);
    if (p) {
      char addr[64] = {0};
      p += strlen("\"tcp_addr\":\"");
      for (int i = 0; i < 63 && p[i] && p[i] != '"'; i++) addr[i] = p[i];
      kvf_config *c2 = config((const char *[][2]){{"secret", "s"}, {"name", "c-bind"}, {"listen", addr}, {NULL, NULL}});
      kvf_agent *dup = NULL;
      NOTE(kvf_agent_new(c2, &dup), KVF_IO);
      CHECK(dup == NULL);
      kvf_config_free(c2);
    }
  }
  /* Unreachable etcd. */
  {
    kvf_config *c3 = config((const char *[][2]){{"secret", "s"}, {"name", "c-etcd"}, {"etcd", "http://127.0.0.1:1"}, {NULL, NULL}});
    kvf_agent *a3 = NULL;
    NOTE(kvf_agent_new(c3, &a3), KVF_CONTROL_PLANE);
    CHECK(a3 == NULL);
    kvf_config_free(c3);
  }

  size_t name_len = 0;
  NOTE(kvf_agent_name(agent, text, 3, &name_len), KVF_BUFFER_TOO_SMALL);
  CHECK(name_len == strlen("c-errors") + 1);
  MUST(kvf_agent_name(agent, text, sizeof text, &name_len));
  CHECK(strcmp(text, "c-errors") == 0);

  /* Memory. */
  enum { CAP = 16 };
  unsigned char *src = calloc(CAP, BLOCK), *dst = calloc(CAP, BLOCK);
  uint64_t rsrc = 0, rdst = 0;
  NOTE(kvf_agent_register(agent, NULL, 64, KVF_MEM_HOST, false, &rsrc), KVF_NULL_PARAMETER);
  NOTE(kvf_agent_register(agent, src, 0, KVF_MEM_HOST, false, &rsrc), KVF_INVALID_ARGUMENT);
  NOTE(kvf_agent_register(agent, src, 64, KVF_MEM_DEVICE, false, &rsrc), KVF_UNSUPPORTED);
  NOTE(kvf_agent_register(agent, src, 64, 9, false, &rsrc), KVF_INVALID_ARGUMENT);
  NOTE(kvf_agent_register(agent, src, 64, KVF_MEM_HOST, false, NULL), KVF_NULL_PARAMETER);
  MUST(kvf_agent_register(agent, src, (size_t)CAP * BLOCK, KVF_MEM_HOST, true, &rsrc));
  MUST(kvf_agent_register(agent, dst, (size_t)CAP * BLOCK, KVF_MEM_HOST, true, &rdst));
  NOTE(kvf_agent_deregister(agent, 0xdeadbeef), KVF_NOT_FOUND);
  MUST(kvf_agent_last_error(agent, text, sizeof text, &len));
  CHECK(strstr(text, "unknown region") != NULL);

  /* Peers and transfers. */
  NOTE(kvf_agent_load_peer(agent, (const uint8_t *)"{not json", 9), KVF_INVALID_ARGUMENT);
  NOTE(kvf_agent_remove_peer(agent, "nobody"), KVF_NOT_FOUND);
  kvf_desc l = {.region = rsrc, .offset = 0, .len = 1024}, r = {.region = rdst, .offset = 0, .len = 1024};
  kvf_op *op = NULL;
  NOTE(kvf_agent_transfer(agent, KVF_OP_WRITE, "nobody", &l, &r, 1, NULL, 0, 0, 0, &op), KVF_NOT_FOUND);
  NOTE(kvf_agent_transfer(agent, 7, "c-errors", &l, &r, 1, NULL, 0, 0, 0, &op), KVF_INVALID_ARGUMENT);
  NOTE(kvf_agent_transfer(agent, KVF_OP_WRITE, "c-errors", &l, &r, 1, NULL, 0, 0x80, 0, &op), KVF_INVALID_ARGUMENT);
  NOTE(kvf_agent_transfer(agent, KVF_OP_WRITE, "c-errors", &l, &r, 0, NULL, 0, 0, 0, &op), KVF_INVALID_ARGUMENT);
  NOTE(kvf_agent_transfer(agent, KVF_OP_WRITE, "c-errors", NULL, &r, 1, NULL, 0, 0, 0, &op), KVF_NULL_PARAMETER);
  kvf_desc far = {.region = rsrc, .offset = (uint64_t)CAP * BLOCK - 10, .len = 1024};
  NOTE(kvf_agent_transfer(agent, KVF_OP_WRITE, "c-errors", &far, &r, 1, NULL, 0, 0, 0, &op), KVF_OUT_OF_BOUNDS);
  /* A local transfer (to itself) works. */
  memset(src, 0x5a, 1024);
  MUST(kvf_agent_transfer(agent, KVF_OP_WRITE, "c-errors", &l, &r, 1, NULL, 0, 0, 0, &op));
  uint64_t count = 0;
  bool done = false;
  MUST(wait_op(op, &count));
  MUST(kvf_op_poll(op, &done));
  CHECK(done && count == 1024 && dst[0] == 0x5a && dst[1023] == 0x5a);
  NOTE(kvf_op_poll(op, NULL), KVF_NULL_PARAMETER);
  kvf_op_free(op);
  op = NULL;
  /* No notification is coming. */
  {
    char from[64];
    uint8_t msg[64];
    size_t fl = 0, ml = 0;
    NOTE(kvf_agent_wait_notification(agent, 50, from, sizeof from, &fl, msg, sizeof msg, &ml), KVF_TIMED_OUT);
  }

  /* Store. */
  kvf_store *store = NULL;
  kvf_config *sc = config((const char *[][2]){{"block_tokens", "4"}, {"host_blocks", "4"}, {NULL, NULL}});
  NOTE(kvf_store_new(agent, sc, &store), KVF_INVALID_CONFIG); /* no block size */
  MUST(kvf_config_set(sc, "model", "no-such-model"));
  NOTE(kvf_store_new(agent, sc, &store), KVF_INVALID_CONFIG);
  MUST(kvf_config_set(sc, "block_bytes", "4096"));
  MUST(kvf_config_set(sc, "disk_path", "/dev/null/kvfabric/slots"));
  NOTE(kvf_store_new(agent, sc, &store), KVF_IO);
  kvf_config_free(sc);
  sc = config((const char *[][2]){{"block_tokens", "4"}, {"host_blocks", "4"}, {"block_bytes", "4096"}, {NULL, NULL}});
  NOTE(kvf_store_new(NULL, sc, &store), KVF_NULL_PARAMETER);
  MUST(kvf_store_new(agent, sc, &store));
  kvf_config_free(sc);

  uint32_t bt = 0;
  uint64_t bb = 0;
  MUST(kvf_store_block_info(store, &bt, &bb));
  CHECK(bt == BT && bb == BLOCK);
  uint64_t hashes[NB];
  size_t nh = 0;
  NOTE(kvf_store_hashes(store, tok, NTOK, hashes, 2, &nh), KVF_BUFFER_TOO_SMALL);
  CHECK(nh == NB);
  MUST(kvf_store_hashes(store, tok, NTOK, hashes, NB, &nh));
  CHECK(nh == NB && hashes[0] != hashes[1]);

  size_t hits = 99;
  uint8_t tiers[NB];
  MUST(kvf_store_lookup(store, tok, NTOK, tiers, NB, &hits));
  CHECK(hits == 0);
  NOTE(kvf_store_lookup(store, NULL, NTOK, tiers, NB, &hits), KVF_NULL_PARAMETER);

  kvf_segment seg[2];
  layout(rsrc, CAP, seg);
  uint32_t ids[NB] = {0, 1, 2, 3, 4, 5};
  fill(src, CAP, ids);
  /* Bad layouts and ranges are refused before anything moves. */
  kvf_segment short_seg[1] = {seg[0]};
  NOTE(kvf_store_save(store, tok, NTOK, 0, ids, 3, short_seg, 1, &op), KVF_INVALID_ARGUMENT);
  uint32_t far_ids[1] = {CAP};
  NOTE(kvf_store_save(store, tok, NTOK, 0, far_ids, 1, seg, 2, &op), KVF_OUT_OF_BOUNDS);
  kvf_segment gone[2] = {seg[0], seg[1]};
  gone[1].region = 0x77777777;
  NOTE(kvf_store_save(store, tok, NTOK, 0, ids, 1, gone, 2, &op), KVF_NOT_FOUND);
  NOTE(kvf_store_save(store, tok, NTOK, 4, ids, 3, seg, 2, &op), KVF_INVALID_ARGUMENT); /* 7 > 6 blocks */
  NOTE(kvf_store_save(store, tok, NTOK, 0, ids, 3, seg, 2, NULL), KVF_NULL_PARAMETER);
  /* More blocks than the host tier holds: refused whole. */
  MUST(kvf_store_save(store, tok, NTOK, 0, ids, 5, seg, 2, &op));
  NOTE(kvf_op_wait(op, 20000, &count), KVF_FULL);
  MUST(kvf_op_error(op, text, sizeof text, &len));
  CHECK(strstr(text, "full") != NULL);
  kvf_op_free(op);
  MUST(kvf_store_lookup(store, tok, NTOK, tiers, NB, &hits));
  CHECK(hits == 0);
  /* Three blocks, then the same three again (skipped). */
  MUST(kvf_store_save(store, tok, NTOK, 0, ids, 3, seg, 2, &op));
  MUST(wait_op(op, &count));
  CHECK(count == 3);
  kvf_op_free(op);
  MUST(kvf_store_save(store, tok, NTOK, 0, ids, 3, seg, 2, &op));
  MUST(wait_op(op, &count));
  CHECK(count == 0);
  kvf_op_free(op);
  MUST(kvf_store_lookup(store, tok, NTOK, tiers, NB, &hits));
  CHECK(hits == 3 && tiers[0] == KVF_TIER_HOST && tiers[2] == KVF_TIER_HOST);
  MUST(kvf_store_lookup(store, tok, NTOK, NULL, 0, &hits)); /* count only */
  CHECK(hits == 3);

  /* Load them into other blocks of another region, in reverse order. */
  memset(dst, 0, (size_t)CAP * BLOCK);
  kvf_segment dseg[2];
  layout(rdst, CAP, dseg);
  uint32_t rev[NB] = {9, 8, 7, 6, 5, 4};
  MUST(kvf_store_load(store, tok, NTOK, 0, rev, 3, dseg, 2, &op));
  MUST(wait_op(op, &count));
  CHECK(count == 3);
  CHECK(matches(dst, CAP, rev, 3));
  /* The op is not freed: its region is in use. */
  NOTE(kvf_agent_deregister(agent, rdst), KVF_IN_USE);
  kvf_op_free(op);
  /* Only the first block from a later offset: block 1 into block 12. */
  uint32_t one[1] = {12};
  MUST(kvf_store_load(store, tok, NTOK, 1, one, 1, dseg, 2, &op));
  MUST(wait_op(op, &count));
  CHECK(count == 1);
  kvf_op_free(op);
  {
    int ok = 1;
    for (int i = 0; i < BLOCK; i++) {
      size_t at = i < HALF ? (size_t)(12 * HALF + i) : (size_t)CAP * HALF + 12 * HALF + (size_t)(i - HALF);
      if (dst[at] != pattern(1, i)) ok = 0;
    }
    CHECK(ok);
  }
  /* Asking for more than is held loads the leading run. */
  MUST(kvf_store_load(store, tok, NTOK, 0, rev, 6, dseg, 2, &op));
  MUST(wait_op(op, &count));
  CHECK(count == 3);
  kvf_op_free(op);

  /* A tenant's handle: the same store under a salted seed. The store's own blocks are a
     miss for it; what it saves is a hit for the same salt only; it outlives the handle it
     was opened from, and the store closes with its last handle. */
  {
    kvf_store *alice = NULL, *bob = NULL, *again = NULL;
    NOTE(kvf_store_salted(store, NULL, &alice), KVF_NULL_PARAMETER);
    NOTE(kvf_store_salted(store, "alice", NULL), KVF_NULL_PARAMETER);
    MUST(kvf_store_salted(store, "alice", &alice));
    MUST(kvf_store_salted(store, "bob", &bob));
    uint64_t salted[NB], same[NB];
    MUST(kvf_store_hashes(alice, tok, NTOK, salted, NB, &nh));
    CHECK(nh == NB && salted[0] != hashes[0] && salted[5] != hashes[5]);
    MUST(kvf_store_lookup(alice, tok, NTOK, tiers, NB, &hits));
    CHECK(hits == 0); /* the store holds these tokens' first 3 blocks, unsalted */
    MUST(kvf_store_save(alice, tok, NTOK, 0, ids, 1, seg, 2, &op)); /* the host's 4th slot */
    MUST(wait_op(op, &count));
    CHECK(count == 1);
    kvf_op_free(op);
    MUST(kvf_store_lookup(alice, tok, NTOK, tiers, NB, &hits));
    CHECK(hits == 1);
    MUST(kvf_store_lookup(bob, tok, NTOK, tiers, NB, &hits));
    CHECK(hits == 0);
    MUST(kvf_store_lookup(store, tok, NTOK, tiers, NB, &hits));
    CHECK(hits == 3);
    /* An empty salt keeps the seed of the handle it is opened from. */
    MUST(kvf_store_salted(alice, "", &again));
    kvf_store_free(alice);
    MUST(kvf_store_hashes(again, tok, NTOK, same, NB, &nh));
    CHECK(nh == NB && same[0] == salted[0] && same[5] == salted[5]);
    MUST(kvf_store_lookup(again, tok, NTOK, tiers, NB, &hits));
    CHECK(hits == 1);
    kvf_store_free(again);
    kvf_store_free(bob);
  }
  {
    /* The store's first handle freed before the tenant's: the store stays open. */
    kvf_config *tc = config((const char *[][2]){{"block_tokens", "4"}, {"host_blocks", "2"}, {"block_bytes", "4096"}, {NULL, NULL}});
    kvf_store *first = NULL, *tenant = NULL;
    MUST(kvf_store_new(agent, tc, &first));
    kvf_config_free(tc);
    MUST(kvf_store_salted(first, "tenant", &tenant));
    kvf_store_free(first);
    MUST(kvf_store_save(tenant, tok, NTOK, 0, ids, 2, seg, 2, &op));
    MUST(wait_op(op, &count));
    CHECK(count == 2);
    kvf_op_free(op);
    MUST(kvf_store_lookup(tenant, tok, NTOK, tiers, NB, &hits));
    CHECK(hits == 2);
    kvf_store_free(tenant);
  }

  /* KV events for the engine's own blocks. */
  MUST(kvf_store_publish_stored(store, tok, NTOK, 0, 6, KVF_TIER_DEVICE));
  NOTE(kvf_store_publish_stored(store, tok, NTOK, 0, 6, 9), KVF_INVALID_ARGUMENT);
  NOTE(kvf_store_publish_stored(store, tok, NTOK, 5, 2, KVF_TIER_DEVICE), KVF_INVALID_ARGUMENT);
  MUST(kvf_store_publish_removed(store, hashes, 2, KVF_TIER_DEVICE));
  NOTE(kvf_store_publish_removed(store, hashes, 0, KVF_TIER_DEVICE), KVF_INVALID_ARGUMENT);

  /* Node info and nodes need serve / remote. */
  NOTE(kvf_store_node_info(store, (uint8_t *)text, sizeof text, &len), KVF_INVALID_ARGUMENT);
  NOTE(kvf_store_add_node(store, (const uint8_t *)"{}", 2), KVF_INVALID_ARGUMENT);
  MUST(kvf_store_last_error(store, text, sizeof text, &len));
  CHECK(strstr(text, "remote") != NULL);

  /* A dead peer: its metadata loads, its transfers fail. */
  {
    kvf_config *dc = config((const char *[][2]){{"secret", "c-test-secret"}, {"name", "c-dead"}, {NULL, NULL}});
    kvf_agent *dead = NULL;
    MUST(kvf_agent_new(dc, &dead));
    kvf_config_free(dc);
    unsigned char *mem = calloc(1, 4096);
    uint64_t dreg = 0;
    MUST(kvf_agent_register(dead, mem, 4096, KVF_MEM_HOST, true, &dreg));
    unsigned char md[4096];
    size_t n = 0;
    MUST(kvf_agent_metadata(dead, md, sizeof md, &n));
    /* Make the peer look remote (another host), so that the transfer needs its socket. */
    char *h = strstr((char *)md, "\"host_id\":\"");
    if (h) h[strlen("\"host_id\":\"")] ^= 1;
    MUST(kvf_agent_deregister(dead, dreg));
    kvf_agent_free(dead);
    free(mem);
    MUST(kvf_agent_load_peer(agent, md, n));
    kvf_desc dr = {.region = dreg, .offset = 0, .len = 1024};
    kvf_result rr = kvf_agent_transfer(agent, KVF_OP_WRITE, "c-dead", &l, &dr, 1, NULL, 0, 0, 2000, &op);
    CHECK(rr == KVF_OK);
    if (rr == KVF_OK) {
      NOTE(kvf_op_wait(op, 20000, &count), KVF_TRANSFER);
      kvf_op_free(op);
    }
    MUST(kvf_agent_remove_peer(agent, "c-dead"));
  }

  kvf_store_free(store);
  MUST(kvf_agent_deregister(agent, rsrc));
  MUST(kvf_agent_deregister(agent, rdst));
  kvf_agent_free(agent);
  kvf_config_free(c);
  free(src);
  free(dst);

  /* Every code reachable from C was returned at least once. */
  static const kvf_result reachable[] = {
      KVF_NULL_PARAMETER, KVF_INVALID_ARGUMENT, KVF_INVALID_CONFIG, KVF_BUFFER_TOO_SMALL,
      KVF_NOT_FOUND,      KVF_OUT_OF_BOUNDS,    KVF_IN_USE,         KVF_FULL,
      KVF_TIMED_OUT,      KVF_TRANSFER,         KVF_IO,             KVF_CONTROL_PLANE,
      KVF_UNSUPPORTED};
  for (size_t i = 0; i < sizeof reachable / sizeof reachable[0]; i++) {
    if (!seen[reachable[i] - 7000]) {
      fprintf(stderr, "code %u was never returned\n", (unsigned)reachable[i]);
      failures++;
    }
  }
  return failures;
}

/* Length-prefixed messages over a pipe. */
static void send_msg(int fd, const void *p, size_t n) {
  uint32_t len = (uint32_t)n;
  if (write(fd, &len, 4) != 4 || write(fd, p, n) != (ssize_t)n) abort();
}

static size_t recv_msg(int fd, void *p, size_t cap) {
  uint32_t len = 0;
  size_t got = 0;
  while (got < 4) {
    ssize_t k = read(fd, (char *)&len + got, 4 - got);
    if (k <= 0) return 0;
    got += (size_t)k;
  }
  if (len > cap) abort();
  got = 0;
  while (got < len) {
    ssize_t k = read(fd, (char *)p + got, len - got);
    if (k <= 0) return 0;
    got += (size_t)k;
  }
  return len;
}

enum { CAPX = 32 };

static int child(int in, int out_fd) {
  (void)out_fd;
  uint32_t tok[NTOK];
  tokens(tok);
  kvf_config *c = config((const char *[][2]){{"secret", "c-test-secret"}, {"name", "c-child"}, {"block_tokens", "4"},
                                             {"block_bytes", "4096"}, {"host_blocks", "16"}, {"remote", "1"}, {NULL, NULL}});
  kvf_agent *agent = NULL;
  kvf_store *store = NULL;
  MUST(kvf_agent_new(c, &agent));
  MUST(kvf_store_new(agent, c, &store));
  kvf_config_free(c);
  if (failures) return failures;
  unsigned char *dst = calloc(CAPX, BLOCK);
  uint64_t rdst = 0;
  MUST(kvf_agent_register(agent, dst, (size_t)CAPX * BLOCK, KVF_MEM_HOST, false, &rdst));

  static unsigned char msg[65536];
  size_t n = recv_msg(in, msg, sizeof msg);
  CHECK(n > 0);
  MUST(kvf_store_add_node(store, msg, n));

  size_t hits = 0;
  uint8_t tiers[NB];
  MUST(kvf_store_lookup(store, tok, NTOK, tiers, NB, &hits));
  CHECK(hits == NB);
  for (size_t i = 0; i < hits && i < NB; i++) CHECK(tiers[i] == KVF_TIER_REMOTE);

  kvf_segment seg[2];
  layout(rdst, CAPX, seg);
  uint32_t ids[NB] = {20, 3, 17, 5, 11, 0};
  kvf_op *op = NULL;
  uint64_t count = 0;
  MUST(kvf_store_load(store, tok, NTOK, 0, ids, NB, seg, 2, &op));
  MUST(wait_op(op, &count));
  kvf_op_free(op);
  CHECK(count == NB);
  CHECK(matches(dst, CAPX, ids, NB));
  /* Now held locally. */
  MUST(kvf_store_lookup(store, tok, NTOK, tiers, NB, &hits));
  CHECK(hits == NB && tiers[0] == KVF_TIER_HOST);

  /* Write the blocks back into the parent's inbox, in block order, with a notification. */
  n = recv_msg(in, msg, sizeof msg);
  MUST(kvf_agent_load_peer(agent, msg, n));
  uint64_t inbox = 0;
  CHECK(recv_msg(in, &inbox, sizeof inbox) == sizeof inbox);
  kvf_desc local[2 * NB], remote[2 * NB];
  for (int b = 0; b < NB; b++) {
    local[2 * b] = (kvf_desc){rdst, (uint64_t)ids[b] * HALF, HALF};
    local[2 * b + 1] = (kvf_desc){rdst, (uint64_t)CAPX * HALF + (uint64_t)ids[b] * HALF, HALF};
    remote[2 * b] = (kvf_desc){inbox, (uint64_t)b * BLOCK, HALF};
    remote[2 * b + 1] = (kvf_desc){inbox, (uint64_t)b * BLOCK + HALF, HALF};
  }
  MUST(kvf_agent_transfer(agent, KVF_OP_WRITE, "c-parent", local, remote, 2 * NB, (const uint8_t *)"done", 4,
                          KVF_TRANSFER_CHECKSUM, 0, &op));
  MUST(wait_op(op, &count));
  CHECK(count == (uint64_t)NB * BLOCK);
  kvf_op_free(op);

  kvf_store_free(store);
  MUST(kvf_agent_deregister(agent, rdst));
  kvf_agent_free(agent);
  free(dst);
  return failures;
}

static int test_exchange(void) {
  int to_child[2], from_child[2];
  if (pipe(to_child) || pipe(from_child)) return 1;
  /* Fork before the library starts any thread. */
  pid_t pid = fork();
  if (pid == 0) {
    close(to_child[1]);
    close(from_child[0]);
    int f = child(to_child[0], from_child[1]);
    if (f) fprintf(stderr, "child: %d failure(s)\n", f);
    _exit(f ? 1 : 0);
  }
  close(to_child[0]);
  close(from_child[1]);

  uint32_t tok[NTOK];
  tokens(tok);
  kvf_config *c = config((const char *[][2]){{"secret", "c-test-secret"}, {"name", "c-parent"}, {"block_tokens", "4"},
                                             {"block_bytes", "4096"}, {"host_blocks", "16"}, {"serve", "1"}, {NULL, NULL}});
  kvf_agent *agent = NULL;
  kvf_store *store = NULL;
  MUST(kvf_agent_new(c, &agent));
  MUST(kvf_store_new(agent, c, &store));
  kvf_config_free(c);
  if (failures) return failures;
  unsigned char *src = calloc(CAPX, BLOCK), *inbox = calloc(NB, BLOCK);
  uint64_t rsrc = 0, rinbox = 0;
  MUST(kvf_agent_register(agent, src, (size_t)CAPX * BLOCK, KVF_MEM_HOST, false, &rsrc));
  MUST(kvf_agent_register(agent, inbox, (size_t)NB * BLOCK, KVF_MEM_HOST, true, &rinbox));
  uint32_t ids[NB] = {1, 2, 3, 4, 5, 6};
  fill(src, CAPX, ids);
  kvf_segment seg[2];
  layout(rsrc, CAPX, seg);
  kvf_op *op = NULL;
  uint64_t count = 0;
  MUST(kvf_store_save(store, tok, NTOK, 0, ids, NB, seg, 2, &op));
  MUST(wait_op(op, &count));
  CHECK(count == NB);
  kvf_op_free(op);

  static unsigned char msg[65536];
  size_t n = 0;
  MUST(kvf_store_node_info(store, msg, sizeof msg, &n));
  send_msg(to_child[1], msg, n);
  MUST(kvf_agent_metadata(agent, msg, sizeof msg, &n)); /* exported after the inbox */
  send_msg(to_child[1], msg, n);
  send_msg(to_child[1], &rinbox, sizeof rinbox);

  char from[64];
  uint8_t note_msg[64];
  size_t fl = 0, ml = 0;
  MUST(kvf_agent_wait_notification(agent, 30000, from, sizeof from, &fl, note_msg, sizeof note_msg, &ml));
  CHECK(strcmp(from, "c-child") == 0 && ml == 4 && memcmp(note_msg, "done", 4) == 0);
  int ok = 1;
  for (int b = 0; b < NB; b++)
    for (int i = 0; i < BLOCK; i++)
      if (inbox[(size_t)b * BLOCK + (size_t)i] != pattern(b, i)) ok = 0;
  CHECK(ok);

  int status = 0;
  waitpid(pid, &status, 0);
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);

  kvf_store_free(store);
  MUST(kvf_agent_deregister(agent, rsrc));
  MUST(kvf_agent_deregister(agent, rinbox));
  kvf_agent_free(agent);
  free(src);
  free(inbox);
  return failures;
}

int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: %s errors|exchange\n", argv[0]);
    return 2;
  }
  int f = strcmp(argv[1], "errors") == 0 ? test_errors() : strcmp(argv[1], "exchange") == 0 ? test_exchange() : -1;
  if (f < 0) return 2;
  printf("%s: %s (%d failure(s))\n", argv[1], f ? "FAILED" : "ok", f);
  return f ? 1 : 0;
}
