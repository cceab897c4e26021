//! Notifications over RDMA: a peer's mailbox (WRITEs with immediate data into its slots), our
//! staging buffer for it, and how a received notification is copied out and delivered.

use super::*;

/// The sender's side of a peer's mailbox: one staging slot, and the next sequence number;
/// notifications to one peer go one at a time (their order on the first queue pair is the
/// order of their sequence numbers, which name the mailbox slots).
#[derive(Debug)]
pub(super) struct Outbox {
    // Declared before the buffer it registers: dropped first.
    pub(super) mr: Mr,
    pub(super) buf: RawBuf,
    pub(super) seq: tokio::sync::Mutex<u32>,
}

/// The owner's side: where one peer's notifications land, `MAILBOX_SLOTS` slots written by
/// WRITEs with immediate data. A slot is copied out when its receive completes and the
/// receive posted again at once; the notification goes to the inbox's one delivery task, in
/// order, which waits for room in the agent's queue. Past `INBOX_BACKLOG` waiting
/// notifications (a consumer that does not drain), new ones are dropped, counted and logged
/// rather than stalling the peer's data (which shares the queue pair).
#[derive(Debug)]
pub(super) struct Inbox {
    // Declared before the buffer it registers: dropped first.
    pub(super) _mr: Mr,
    pub(super) buf: RawBuf,
    pub(super) id: u32,
    pub(super) slot_bytes: u32,
    pub(super) peer: String,
    pub(super) conn: Weak<Connection>,
    pub(super) deliveries: tokio::sync::mpsc::Sender<crate::endpoint::Notification>,
}

/// Notifications an inbox holds for delivery at most.
pub(super) const INBOX_BACKLOG: usize = 4096;
/// How long a peer's replaced incoming connection lives on (its last work and notifications).
pub(super) const RETIRE_GRACE: Duration = Duration::from_secs(5);

/// A zeroed heap buffer that the adapter reads or writes while we hold it: only raw pointers
/// touch its bytes (no reference to them is ever made).
#[derive(Debug)]
pub(super) struct RawBuf {
    pub(super) ptr: std::ptr::NonNull<u8>,
    pub(super) len: usize,
}

// SAFETY: a plain heap allocation; concurrent access is ordered by the protocol around it
// (staged under the sequence lock, copied out after its receive completed).
unsafe impl Send for RawBuf {}
// SAFETY: as above.
unsafe impl Sync for RawBuf {}

impl RawBuf {
    pub(super) fn zeroed(len: usize) -> RawBuf {
        let layout = std::alloc::Layout::from_size_align(len.max(1), 64).expect("a small buffer");
        // SAFETY: a non-zero size.
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr =
            std::ptr::NonNull::new(p).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        RawBuf { ptr, len: len.max(1) }
    }

    pub(super) fn addr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// A copy of `len` bytes at `at`; None when they are not all inside.
    pub(super) fn copy_out(&self, at: usize, len: usize) -> Option<Vec<u8>> {
        if at.checked_add(len)? > self.len {
            return None;
        }
        let mut v = vec![0u8; len];
        // SAFETY: the range is inside the allocation (checked); bytes copied through raw
        // pointers only.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.as_ptr().add(at), v.as_mut_ptr(), len) };
        Some(v)
    }

    /// Writes `parts` one after the other from offset 0; false when they do not fit.
    pub(super) fn stage(&self, parts: &[&[u8]]) -> bool {
        let total: usize = parts.iter().map(|p| p.len()).sum();
        if total > self.len {
            return false;
        }
        let mut at = 0;
        for p in parts {
            // SAFETY: inside the allocation (the total fits); raw pointers only.
            unsafe {
                std::ptr::copy_nonoverlapping(p.as_ptr(), self.ptr.as_ptr().add(at), p.len())
            };
            at += p.len();
        }
        true
    }
}

impl Drop for RawBuf {
    fn drop(&mut self) {
        let layout = std::alloc::Layout::from_size_align(self.len, 64).expect("as allocated");
        // SAFETY: allocated in `zeroed` with this layout, freed once.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) };
    }
}

/// Slots of a notification mailbox (receives posted on the first queue pair).
pub(super) const MAILBOX_SLOTS: u16 = device::RECV_DEPTH as u16;
/// The queue pair index of receives' work request ids (no connection has that many queue
/// pairs); their transfer field is the inbox's id.
pub(super) const RECV_QP: u8 = u8::MAX;

/// A receive of inbox `inbox` was consumed: a notification landed in its slot. It is copied
/// out at once, delivered in order on the runtime, and the receive posted again once it was.
pub(super) fn received(shared: &Shared, inbox: u32, c: &verbs::IbvWc) {
    let Some(inbox) = shared.inboxes.lock().get(&inbox).cloned() else { return };
    if c.status != verbs::consts::WC_SUCCESS {
        // A flushed receive: the connection is going. Anything else broke it.
        if c.status != verbs::consts::WC_WR_FLUSH_ERR {
            tracing::warn!(peer = %inbox.peer, status = completion::status_name(c.status), "RDMA: a mailbox receive failed; the connection is dropped");
            if let Some(conn) = inbox.conn.upgrade() {
                conn.fail();
            }
        }
        return;
    }
    if c.opcode != verbs::consts::WC_RECV_RDMA_WITH_IMM {
        return;
    }
    let seq = u32::from_be(c.imm_data);
    let sb = inbox.slot_bytes as usize;
    let at = (seq % u32::from(MAILBOX_SLOTS)) as usize * sb;
    // The peer's bytes: hostile. Copy the slot out as it is, then check the copy.
    let slot = inbox.buf.copy_out(at, sb);
    // The slot is free once copied: its receive goes back at once (the next message for
    // this slot needs it, and comes after this one). Senders are never held back here.
    if let Some(conn) = inbox.conn.upgrade() {
        let id = WrId { transfer: inbox.id, qp: RECV_QP, index: 0 }.pack();
        if let Err(e) = conn.qps[0].post_receives(&[id]) {
            tracing::warn!(peer = %inbox.peer, error = %e, "RDMA: a mailbox receive could not be posted again");
        }
    }
    let Some(slot) = slot else { return };
    let transfer_id = u64::from_le_bytes(slot[..8].try_into().unwrap_or_default());
    let len = u32::from_le_bytes(slot[8..12].try_into().unwrap_or_default()) as usize;
    if len > sb - MAILBOX_HEADER_BYTES {
        tracing::warn!(peer = %inbox.peer, len, "RDMA: a notification longer than its mailbox slot was dropped");
        return;
    }
    let message = slot[MAILBOX_HEADER_BYTES..MAILBOX_HEADER_BYTES + len].to_vec();
    // In order, through the inbox's one delivery task; counted before it is handed over, so
    // that whoever has the notification sees it counted.
    match inbox.deliveries.try_reserve() {
        Ok(permit) => {
            shared.notifications_received.fetch_add(1, Ordering::Relaxed);
            permit.send(crate::endpoint::Notification {
                from: inbox.peer.clone(),
                transfer_id,
                message,
            });
        }
        Err(_) => {
            shared.notifications_dropped.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(peer = %inbox.peer, backlog = INBOX_BACKLOG, "RDMA: a notification was dropped: the agent's notification queue is not drained");
        }
    };
}
