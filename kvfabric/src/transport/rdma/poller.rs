//! The completion side: one thread polls the completion queue (spinning briefly, then
//! sleeping on the channel) and the device's async events, and fails the transport when the
//! device does.

use super::*;

/// How long the completion thread spins on an empty queue before it sleeps until the next
/// completion (completions of a busy transfer come every few microseconds).
pub(super) const SPIN: Duration = Duration::from_micros(50);
/// Longest sleep of the completion thread: it then looks at its stop flag.
pub(super) const SLEEP_MAX: Duration = Duration::from_millis(20);

/// The completion queue failed (its device is gone): transfers in flight fail with `e`, and
/// the transport stops ([`RdmaTransport::failure`]: the agent routes over TCP).
pub(super) fn device_failed(shared: &Shared, e: &device::VerbsError) {
    tracing::error!(error = %e, "RDMA completion queue failed; transfers in flight fail, later ones go over TCP");
    *shared.poll_error.lock() = Some(e.to_string());
    for f in shared.inflight.lock().values() {
        f.wake.notify_one();
    }
}

pub(super) fn poll_loop(cq: &Cq, shared: &Shared) {
    let mut wc = vec![verbs::IbvWc::default(); 64];
    let mut idle = 0u32;
    let mut busy = Instant::now();
    // With a completion channel: armed for the next completion's event.
    let (mut events, mut armed) = (cq.has_channel(), false);
    while !shared.stop.load(Ordering::Acquire) {
        let n = match cq.poll(&mut wc) {
            Ok(n) => n,
            Err(e) => return device_failed(shared, &e),
        };
        if n == 0 {
            if busy.elapsed() < SPIN {
                std::hint::spin_loop();
                continue;
            }
            if events {
                // Sleep until the adapter has a completion: arm, poll once more (one that
                // came before the arm raises no event), then wait for the event.
                if !armed {
                    match cq.arm() {
                        Ok(()) => armed = true,
                        Err(e) => {
                            tracing::warn!(error = %e, "RDMA: completion events failed; the completion queue is polled");
                            events = false;
                        }
                    }
                    continue;
                }
                armed = false;
                match cq.wait(SLEEP_MAX) {
                    // Completions are coming: spin again for the next ones.
                    Ok(true) => {
                        shared.woken.fetch_add(1, Ordering::Relaxed);
                        busy = Instant::now();
                    }
                    // Nothing came: arm again and poll once more before the next sleep (a
                    // queue armed twice raises one event).
                    Ok(false) => {}
                    // A provider whose polls go on answering "nothing" for a gone device
                    // (the queue lives in user memory): the channel is what says so.
                    Err(e) if e.call == device::CHANNEL_GONE => return device_failed(shared, &e),
                    Err(e) => {
                        tracing::warn!(error = %e, "RDMA: completion events failed; the completion queue is polled");
                        events = false;
                    }
                }
                continue;
            }
            // No channel: back off to sleeps of up to 1 ms.
            idle = idle.saturating_add(1);
            std::thread::sleep(Duration::from_micros(u64::from(idle.min(1000))));
            continue;
        }
        idle = 0;
        busy = Instant::now();
        let table = shared.inflight.lock();
        for c in &wc[..n] {
            let id = WrId::unpack(c.wr_id);
            if id.qp == RECV_QP {
                received(shared, id.transfer, c);
                continue;
            }
            let Some(f) = table.get(&id.transfer) else { continue };
            let q = usize::from(id.qp);
            let (p, freed) = {
                let mut t = f.tracker.lock();
                let before = t.done(q);
                let p = t.complete(q, id.index, c.status, c.vendor_err, &f.peer);
                (p, t.done(q) - before)
            };
            f.conn.give_room(q, freed);
            if matches!(p, Progress::Finished(_)) {
                let (lock, cv) = &f.done;
                *lock.lock().unwrap_or_else(|p| p.into_inner()) = true;
                cv.notify_all();
            }
            f.wake.notify_one();
        }
    }
}

/// Reads and acknowledges the device's asynchronous events (a queue pair is destroyed only
/// once its events are acknowledged), logging each kind once.
pub(super) fn event_loop(dev: &Device, shared: &Shared) {
    let mut seen = std::collections::HashSet::new();
    while !shared.stop.load(Ordering::Acquire) {
        if let Some((what, qp)) = dev.async_event(Duration::from_millis(100)) {
            if seen.insert(what) {
                tracing::warn!(event = what, qp, device = %dev.info().name, "RDMA asynchronous event");
            } else {
                tracing::debug!(event = what, qp, "RDMA asynchronous event");
            }
        }
    }
}
