//! A transfer's work, polled by the task that runs it and by a caller waiting on its handle.

use std::sync::Arc;

use parking_lot::Mutex;

use super::TransferShared;

/// Which poller of a [`Drive`]: the transfer's own task, or a waiter on its handle.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Role {
    Task = 0,
    Waiter = 1,
}

type Work = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>;

/// A transfer's work, polled by the task that runs it and also by a caller waiting on its
/// handle: whichever runs when the work can progress moves it, the other finds it busy or
/// over. A transfer posted and then awaited thus completes on the waiter's thread, without
/// the two thread wake-ups of a hand-off to the task and back — on a virtual machine they
/// cost more than a small GPU copy. While a waiter helps ([`Drive::help`]) the work wakes
/// it alone (one poller per transfer, not two); a waiter that leaves wakes the task, which
/// carries on. The work is dropped when it completes, or when its task is dropped
/// unfinished (cancelled, or its runtime shut down).
pub(crate) struct Drive {
    work: Mutex<Option<Work>>,
    wakers: Mutex<[Option<std::task::Waker>; 2]>,
    /// Set by a poller that found the work busy: the poller holding it polls again before
    /// it lets go, so the wake-up that poller was answering is not lost.
    repoll: std::sync::atomic::AtomicBool,
}

impl std::fmt::Debug for Drive {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Drive").finish_non_exhaustive()
    }
}

impl Drive {
    pub(crate) fn new(work: impl std::future::Future<Output = ()> + Send + 'static) -> Arc<Self> {
        Arc::new(Drive {
            work: Mutex::new(Some(Box::pin(work))),
            wakers: Mutex::default(),
            repoll: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// Polls the work as `role`: ready once it is over, here or elsewhere.
    pub(crate) fn poll_as(
        self: &Arc<Self>,
        role: Role,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<()> {
        use std::task::Poll;
        {
            let mut wakers = self.wakers.lock();
            let slot = &mut wakers[role as usize];
            if !slot.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                *slot = Some(cx.waker().clone());
            }
        }
        use std::sync::atomic::Ordering::SeqCst;
        let waker = std::task::Waker::from(self.clone());
        loop {
            // Busy: the poller holding the work sees the flag and polls again.
            self.repoll.store(true, SeqCst);
            let Some(mut work) = self.work.try_lock() else { return Poll::Pending };
            loop {
                self.repoll.store(false, SeqCst);
                let Some(fut) = work.as_mut() else {
                    drop(work);
                    self.answer_the_busy();
                    return Poll::Ready(());
                };
                if fut.as_mut().poll(&mut std::task::Context::from_waker(&waker)).is_ready() {
                    let done = work.take();
                    drop(work);
                    drop(done);
                    self.wake_all();
                    return Poll::Ready(());
                }
                if !self.repoll.load(SeqCst) {
                    break;
                }
            }
            drop(work);
            // A poller that found it busy after the last look: take it again.
            if !self.repoll.load(SeqCst) {
                return Poll::Pending;
            }
        }
    }

    /// Moves the work as a waiter until it is over; when this future is dropped (the work
    /// over, or the waiter gone), the task takes over.
    pub(crate) async fn help(self: &Arc<Self>) {
        struct Leave<'a>(&'a Drive);
        impl Drop for Leave<'_> {
            fn drop(&mut self) {
                let task = {
                    let mut wakers = self.0.wakers.lock();
                    wakers[Role::Waiter as usize] = None;
                    wakers[Role::Task as usize].clone()
                };
                if let Some(t) = task {
                    t.wake();
                }
            }
        }
        let _leave = Leave(self);
        std::future::poll_fn(|cx| self.poll_as(Role::Waiter, cx)).await
    }

    /// Drops the work if it is not over: what it holds is released (its task is gone).
    fn abandon(&self) {
        let work = self.work.lock().take();
        if work.is_some() {
            drop(work);
            self.wake_all();
        } else {
            self.answer_the_busy();
        }
    }

    /// Called after letting go of the work without polling it (it was over): a poller that
    /// found it busy meanwhile returned pending, counting on the holder to look again, and
    /// there is nothing left to look at. It is woken to see the end itself. (Missing this,
    /// a waiter that found the work held by the task's final drop waited forever.)
    fn answer_the_busy(&self) {
        if self.repoll.load(std::sync::atomic::Ordering::SeqCst) {
            self.wake_all();
        }
    }

    fn wake_all(&self) {
        let wakers: Vec<std::task::Waker> = self.wakers.lock().iter().flatten().cloned().collect();
        for w in wakers {
            w.wake();
        }
    }
}

#[cfg(test)]
impl Drive {
    pub(crate) fn debug_state(&self) -> String {
        let work = match self.work.try_lock() {
            None => "busy".to_string(),
            Some(w) => format!("some={}", w.is_some()),
        };
        let w = self.wakers.lock();
        format!(
            "work {work}, task waker {}, waiter waker {}, repoll {}",
            w[0].is_some(),
            w[1].is_some(),
            self.repoll.load(std::sync::atomic::Ordering::SeqCst)
        )
    }
}

impl Drive {
    /// The work can progress: the helping waiter moves it if there is one, else the task.
    fn wake_one(&self) {
        let one = {
            let wakers = self.wakers.lock();
            wakers[Role::Waiter as usize].clone().or_else(|| wakers[Role::Task as usize].clone())
        };
        if let Some(w) = one {
            w.wake();
        }
    }
}

impl std::task::Wake for Drive {
    fn wake(self: Arc<Self>) {
        self.wake_one();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.wake_one();
    }
}

/// The task side of a [`Drive`]; dropping it unfinished drops the work.
pub(crate) struct TaskDrive(pub(crate) Arc<Drive>);

impl std::future::Future for TaskDrive {
    type Output = ();

    fn poll(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<()> {
        self.0.poll_as(Role::Task, cx)
    }
}

impl Drop for TaskDrive {
    fn drop(&mut self) {
        self.0.abandon();
    }
}

/// Marks a transfer's task as gone when dropped — also when the task is aborted, since an
/// aborted task's future is dropped only after its current poll returned.
pub(crate) struct ExitGuard(pub(crate) Arc<TransferShared>);

impl Drop for ExitGuard {
    fn drop(&mut self) {
        self.0.exited.store(true, std::sync::atomic::Ordering::Release);
        self.0.exited_notify.notify_waiters();
    }
}
