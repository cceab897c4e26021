// A C++ engine's use of kvfabric through its C header, as TensorRT-LLM or a custom engine
// would: register the engine's KV pool (host memory here), save computed blocks by their
// tokens (kvfabric hashes them as the router does), look up a later prompt's cached prefix,
// and load those blocks into other slots of the pool.
//
// The pool's layout is the engine's, not kvfabric's: per layer, all K pieces of every block,
// then all V pieces (`[layer][K|V][block][piece]`), described to the store by one segment per
// (layer, K|V). Built and run by ffi/tests/c_abi.rs (g++ -std=c++17, through pkg-config):
//     g++ -std=c++17 kv_pool.cpp $(pkg-config --cflags --libs kvfabric) -o kv_pool

#include <kvfabric.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

constexpr uint32_t kBlockTokens = 16;
constexpr uint32_t kLayers = 2;
constexpr uint64_t kPiece = 256;  // bytes of one block's K (or V) in one layer
constexpr uint32_t kPoolBlocks = 32;
constexpr uint64_t kBlockBytes = kLayers * 2 * kPiece;

// Throws with the library's text for a failed call.
void check(kvf_result r, const char* what) {
  if (r == KVF_OK) return;
  char text[256];
  size_t len = 0;
  kvf_result_text(r, text, sizeof text, &len);
  throw std::runtime_error(std::string(what) + ": " + text);
}

struct ConfigDeleter {
  void operator()(kvf_config* c) const { kvf_config_free(c); }
};
struct AgentDeleter {
  void operator()(kvf_agent* a) const { kvf_agent_free(a); }
};
struct StoreDeleter {
  void operator()(kvf_store* s) const { kvf_store_free(s); }
};
struct OpDeleter {
  void operator()(kvf_op* o) const { kvf_op_free(o); }
};
using Config = std::unique_ptr<kvf_config, ConfigDeleter>;
using Agent = std::unique_ptr<kvf_agent, AgentDeleter>;
using Store = std::unique_ptr<kvf_store, StoreDeleter>;
using Op = std::unique_ptr<kvf_op, OpDeleter>;

Config config(std::initializer_list<std::pair<const char*, std::string>> pairs) {
  kvf_config* raw = nullptr;
  check(kvf_config_new(&raw), "kvf_config_new");
  Config c(raw);
  for (const auto& [key, value] : pairs) check(kvf_config_set(c.get(), key, value.c_str()), key);
  return c;
}

// The engine's KV pool and the segments that describe one block in it.
struct Pool {
  std::vector<uint8_t> bytes = std::vector<uint8_t>(kPoolBlocks * kBlockBytes);
  uint64_t region = 0;

  std::vector<kvf_segment> segments() const {
    std::vector<kvf_segment> segs;
    for (uint32_t layer = 0; layer < kLayers; layer++)
      for (uint32_t kv = 0; kv < 2; kv++)
        segs.push_back(kvf_segment{region, (layer * 2 + kv) * kPoolBlocks * kPiece, kPiece, kPiece});
    return segs;
  }

  uint8_t& at(uint32_t block, uint32_t layer, uint32_t kv, uint64_t i) {
    return bytes[(layer * 2 + kv) * kPoolBlocks * kPiece + block * kPiece + i];
  }
};

// What the engine "computed" for block `b` of a prompt, byte `i` of a piece.
uint8_t kv_byte(uint32_t b, uint32_t layer, uint32_t kv, uint64_t i) {
  return static_cast<uint8_t>(b * 31 + layer * 7 + kv * 3 + i);
}

uint64_t wait(kvf_op* raw, const char* what) {
  Op op(raw);
  uint64_t count = 0;
  kvf_result r = kvf_op_wait(op.get(), 20000, &count);
  if (r != KVF_OK) {
    char text[256];
    size_t len = 0;
    kvf_op_error(op.get(), text, sizeof text, &len);
    throw std::runtime_error(std::string(what) + ": " + text);
  }
  return count;
}

void expect(bool ok, const char* what) {
  if (!ok) throw std::runtime_error(std::string("expected: ") + what);
}

void run() {
  auto ac = config({{"name", "cpp-engine"}, {"secret", "cpp-example-secret"}});
  kvf_agent* agent_raw = nullptr;
  check(kvf_agent_new(ac.get(), &agent_raw), "kvf_agent_new");
  Agent agent(agent_raw);

  Pool pool;
  check(kvf_agent_register(agent.get(), pool.bytes.data(), pool.bytes.size(), KVF_MEM_HOST, false,
                           &pool.region),
        "kvf_agent_register");
  auto sc = config({{"block_tokens", std::to_string(kBlockTokens)},
                    {"block_bytes", std::to_string(kBlockBytes)},
                    {"host_blocks", "64"}});
  kvf_store* store_raw = nullptr;
  check(kvf_store_new(agent.get(), sc.get(), &store_raw), "kvf_store_new");
  Store store(store_raw);
  const auto segs = pool.segments();

  // A prompt of 6 full blocks (and a partial one), computed into pool blocks 0..5.
  std::vector<uint32_t> prompt(6 * kBlockTokens + 5);
  for (size_t i = 0; i < prompt.size(); i++) prompt[i] = static_cast<uint32_t>(1000 + i * 7);
  std::vector<uint32_t> ids = {0, 1, 2, 3, 4, 5};
  for (uint32_t b = 0; b < 6; b++)
    for (uint32_t layer = 0; layer < kLayers; layer++)
      for (uint32_t kv = 0; kv < 2; kv++)
        for (uint64_t i = 0; i < kPiece; i++) pool.at(ids[b], layer, kv, i) = kv_byte(b, layer, kv, i);

  size_t hits = 0;
  check(kvf_store_lookup(store.get(), prompt.data(), prompt.size(), nullptr, 0, &hits), "lookup");
  expect(hits == 0, "nothing cached before the save");

  kvf_op* op = nullptr;
  check(kvf_store_save(store.get(), prompt.data(), prompt.size(), 0, ids.data(), ids.size(),
                       segs.data(), segs.size(), &op),
        "kvf_store_save");
  expect(wait(op, "save") == 6, "6 blocks stored");

  // A later prompt sharing the first 4 blocks, then diverging.
  std::vector<uint32_t> later(prompt.begin(), prompt.begin() + 4 * kBlockTokens);
  for (uint32_t i = 0; i < 3 * kBlockTokens; i++) later.push_back(50000 + i);
  uint8_t tiers[8] = {};
  check(kvf_store_lookup(store.get(), later.data(), later.size(), tiers, 8, &hits), "lookup");
  expect(hits == 4, "a 4-block cached prefix");
  for (size_t b = 0; b < hits; b++) expect(tiers[b] == KVF_TIER_HOST, "held in host memory");

  // The sequence hashes the router keys these blocks by.
  std::vector<uint64_t> hashes(8);
  size_t n_hashes = 0;
  check(kvf_store_hashes(store.get(), later.data(), later.size(), hashes.data(), hashes.size(),
                         &n_hashes),
        "kvf_store_hashes");
  expect(n_hashes == 7, "7 full blocks hashed");

  // Load the prefix into other slots of the pool: 20..23.
  std::vector<uint32_t> dst = {20, 21, 22, 23};
  check(kvf_store_load(store.get(), later.data(), later.size(), 0, dst.data(), dst.size(),
                       segs.data(), segs.size(), &op),
        "kvf_store_load");
  expect(wait(op, "load") == 4, "4 blocks loaded");
  for (uint32_t b = 0; b < 4; b++)
    for (uint32_t layer = 0; layer < kLayers; layer++)
      for (uint32_t kv = 0; kv < 2; kv++)
        for (uint64_t i = 0; i < kPiece; i++)
          expect(pool.at(dst[b], layer, kv, i) == kv_byte(b, layer, kv, i), "the loaded bytes");

  store.reset();
  check(kvf_agent_deregister(agent.get(), pool.region), "kvf_agent_deregister");
}

}  // namespace

int main() {
  try {
    run();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "cpp example failed: %s\n", e.what());
    return 1;
  }
  std::printf("cpp example: ok\n");
  return 0;
}
