//! One h2c connection to the upstream, driven with the `h2` crate itself rather than through
//! hyper's HTTP/2 client: a call sends its head from its own task and waits there for the
//! answer, without hyper's dispatch task, its channel, the task it spawns per call to wait for
//! the answer and the one-shot channel that hands the answer back (8 % of the instructions of
//! a proxied gRPC call, docs/grl-sidecar-bench.md). The connection's own task reads and writes
//! the socket.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::Body;
use bytes::Bytes;
use http::{Method, Request, Response};
use hyper::body::{Body as _, Frame, SizeHint};

/// What one gRPC call's answer may have in flight from the upstream before its caller reads.
const STREAM_WINDOW: u32 = 256 << 10;
/// A connection's window: 4 calls' windows. It is one caller connection's (the sidecar opens
/// one per caller connection), so it bounds what that caller's unread calls hold.
const CONNECTION_WINDOW: u32 = 4 * STREAM_WINDOW;
/// The longest answer head (hyper's HTTP/2 client's default).
const MAX_HEADER_LIST: u32 = 16 << 10;
/// What one call's request body may have queued for the upstream beyond its window (hyper's
/// HTTP/2 client's default).
const MAX_SEND_BUFFER: usize = 1 << 20;
/// Streams the connection opens before the upstream's settings say how many it takes
/// (hyper's HTTP/2 client's default, the minimum RFC 9113 recommends to advertise).
const INITIAL_MAX_SEND_STREAMS: usize = 100;

/// A handle on one h2c connection; clones share it.
#[derive(Clone)]
pub(crate) struct H2Handle(Arc<Conn>);

struct Conn {
    /// The one sender of the connection. A call holds it from the moment it asks for a stream
    /// until its stream is open, so that at the upstream's limit of concurrent streams the
    /// calls beyond it wait here, in order, and a call that gives up leaves the queue: h2
    /// itself holds at most one call waiting for a stream (as hyper's client does).
    tx: tokio::sync::Mutex<h2::client::SendRequest<Bytes>>,
    /// Set when the connection's task has ended. When the last handle goes, the sender
    /// with it, h2 wakes the connection, which closes once its calls have ended.
    closed: AtomicBool,
}

impl H2Handle {
    /// The HTTP/2 handshake on `io`; the connection's task is spawned on this thread's
    /// runtime.
    pub(crate) async fn handshake<T>(io: T) -> Result<H2Handle, h2::Error>
    where
        T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        let (tx, conn) = h2::client::Builder::new()
            .initial_window_size(STREAM_WINDOW)
            .initial_connection_window_size(CONNECTION_WINDOW)
            .initial_max_send_streams(INITIAL_MAX_SEND_STREAMS)
            .max_header_list_size(MAX_HEADER_LIST)
            .max_send_buffer_size(MAX_SEND_BUFFER)
            .enable_push(false)
            .handshake::<_, Bytes>(io)
            .await?;
        let handle = H2Handle(Arc::new(Conn {
            tx: tokio::sync::Mutex::new(tx),
            closed: AtomicBool::new(false),
        }));
        // Weakly: the task must not keep the sender, whose drop lets the connection close.
        let state = Arc::downgrade(&handle.0);
        tokio::spawn(async move {
            let r = conn.await;
            if let Some(c) = state.upgrade() {
                c.closed.store(true, Ordering::Relaxed);
            }
            if let Err(e) = r {
                tracing::debug!(error = %e, "upstream h2c connection ended with an error");
            }
        });
        Ok(handle)
    }

    /// Whether the connection's task has ended (its calls all failed or finished).
    pub(crate) fn is_closed(&self) -> bool {
        self.0.closed.load(Ordering::Relaxed)
    }

    /// Whether `other` is a handle on the same connection.
    pub(crate) fn same(&self, other: &H2Handle) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }

    /// Sends one call and waits for its answer's head; `Err(req)` when the connection takes
    /// no new stream (it closed, or the upstream sent GOAWAY): nothing was sent. The head
    /// carries no connection-specific header, and `TE` only as `trailers` (the proxy's
    /// `strip_hop_by_hop` removed them): h2 refuses a call with one, unsent.
    pub(crate) async fn send(
        &self,
        req: Request<Body>,
    ) -> Result<Result<Response<H2Body>, h2::Error>, Request<Body>> {
        let mut tx = self.0.tx.lock().await;
        if std::future::poll_fn(|cx| tx.poll_ready(cx)).await.is_err() {
            return Err(req);
        }
        let (mut head, body) = req.into_parts();
        // As hyper's client: a body of known length says so.
        if let Some(len) = body.size_hint().exact() {
            if len != 0
                || !matches!(
                    head.method,
                    Method::GET | Method::HEAD | Method::DELETE | Method::CONNECT
                )
            {
                head.headers
                    .entry(http::header::CONTENT_LENGTH)
                    .or_insert_with(|| len.into());
            }
        }
        let eos = body.is_end_stream();
        // At the upstream's limit of concurrent streams this call's stream waits to open:
        // the next call waits for that on the lock, not inside h2.
        let sent = match tx.send_request(Request::from_parts(head, ()), eos) {
            Ok(s) => std::future::poll_fn(|cx| tx.poll_ready(cx))
                .await
                .map(|()| s),
            Err(e) => Err(e),
        };
        drop(tx);
        Ok(match sent {
            Ok((answer, stream)) => exchange(answer, (!eos).then(|| Pipe::new(body, stream))).await,
            Err(e) => Err(e),
        })
    }
}

/// Awaits the answer's head while the request body goes (a small one ends in the first
/// poll); a body still streaming when the head arrives (a client-streaming call answered
/// early) goes on in a task of its own, as long as the call's stream lives.
async fn exchange(
    mut answer: h2::client::ResponseFuture,
    mut pipe: Option<Pipe>,
) -> Result<Response<H2Body>, h2::Error> {
    let head = std::future::poll_fn(|cx| {
        if let Some(p) = pipe.as_mut() {
            if let Poll::Ready(r) = Pin::new(p).poll(cx) {
                if let Err(e) = r {
                    // The stream is reset: the answer says so.
                    tracing::debug!(error = %e, "gRPC request body to the upstream failed");
                }
                pipe = None;
            }
        }
        Pin::new(&mut answer).poll(cx)
    })
    .await?;
    if let Some(p) = pipe {
        tokio::spawn(async move {
            if let Err(e) = p.await {
                tracing::debug!(error = %e, "gRPC request body to the upstream failed");
            }
        });
    }
    let (parts, recv) = head.into_parts();
    Ok(Response::from_parts(
        parts,
        H2Body {
            recv,
            data_done: false,
        },
    ))
}

/// A call's request body on its way to the upstream, as the stream's flow control lets it.
struct Pipe {
    body: Body,
    tx: h2::SendStream<Bytes>,
    /// A piece read from the body that waits for the stream's window, and whether it is the
    /// last.
    waiting: Option<(Bytes, bool)>,
    /// Whether a piece with data has gone to h2 yet.
    started: bool,
}

impl Pipe {
    fn new(body: Body, tx: h2::SendStream<Bytes>) -> Pipe {
        Pipe {
            body,
            tx,
            waiting: None,
            started: false,
        }
    }
}

impl Future for Pipe {
    type Output = Result<(), h2::Error>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        loop {
            // Woken by a reset from the upstream too, whatever is awaited below.
            if let Poll::Ready(reason) = this.tx.poll_reset(cx)? {
                return Poll::Ready(Err(h2::Error::from(reason)));
            }
            if let Some((data, eos)) = this.waiting.take() {
                while this.tx.capacity() == 0 {
                    match this.tx.poll_capacity(cx) {
                        Poll::Pending => {
                            this.waiting = Some((data, eos));
                            return Poll::Pending;
                        }
                        Poll::Ready(Some(Ok(_))) => {}
                        Poll::Ready(Some(Err(e))) => return Poll::Ready(Err(e)),
                        // No longer open for sending: ended or reset.
                        Poll::Ready(None) => {
                            return Poll::Ready(Err(h2::Error::from(h2::Reason::CANCEL)))
                        }
                    }
                }
                this.tx.send_data(data, eos)?;
                if eos {
                    return Poll::Ready(Ok(()));
                }
                continue;
            }
            // The body is read before any window is asked for: a claim on the connection's
            // window while the caller sends nothing could stall the connection's other calls
            // with an upstream that reopens its window only once it is used up (hyper's
            // client learnt this, its issue 4003).
            match std::task::ready!(Pin::new(&mut this.body).poll_frame(cx)) {
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) => {
                        let eos = this.body.is_end_stream();
                        // Straight through: an empty piece, which needs no window, and the
                        // first piece, window or not. h2 holds that one (one frame of the
                        // caller's) until the stream has window, and while the stream waits
                        // to open, it leaves with the head in one write (a unary call's whole
                        // request) instead of after it.
                        if data.is_empty() || !this.started {
                            this.started |= !data.is_empty();
                            this.tx.send_data(data, eos)?;
                            if eos {
                                return Poll::Ready(Ok(()));
                            }
                        } else {
                            // A byte asked for; h2 asks for the rest as it queues the piece.
                            this.tx.reserve_capacity(1);
                            this.waiting = Some((data, eos));
                        }
                    }
                    Err(frame) => {
                        if let Ok(trailers) = frame.into_trailers() {
                            this.tx.reserve_capacity(0);
                            this.tx.send_trailers(trailers)?;
                            return Poll::Ready(Ok(()));
                        }
                    }
                },
                Some(Err(e)) => {
                    // The caller's own reset passes on as it came (a cancelled call stays
                    // cancelled upstream), anything else as an internal error.
                    let reason = h2_reason(&e).unwrap_or(h2::Reason::INTERNAL_ERROR);
                    tracing::debug!(error = %e, "the caller's gRPC request body failed");
                    this.tx.send_reset(reason);
                    return Poll::Ready(Err(h2::Error::from(reason)));
                }
                None => {
                    this.tx.send_data(Bytes::new(), true)?;
                    return Poll::Ready(Ok(()));
                }
            }
        }
    }
}

/// The HTTP/2 reason somewhere in `e`'s chain of causes.
fn h2_reason(e: &(dyn std::error::Error + 'static)) -> Option<h2::Reason> {
    let mut cause = Some(e);
    while let Some(c) = cause {
        if let Some(r) = c.downcast_ref::<h2::Error>().and_then(h2::Error::reason) {
            return Some(r);
        }
        cause = c.source();
    }
    None
}

/// An answer's body from the upstream: its data, each piece's window given back as the caller
/// takes it, then its trailers (a gRPC call's status).
pub struct H2Body {
    recv: h2::RecvStream,
    data_done: bool,
}

/// A reset with `NO_ERROR` ends an answer early without failing it (RFC 9113 §8.1).
fn ended_early(e: h2::Error) -> Option<Result<Frame<Bytes>, h2::Error>> {
    (e.reason() != Some(h2::Reason::NO_ERROR)).then_some(Err(e))
}

impl hyper::body::Body for H2Body {
    type Data = Bytes;
    type Error = h2::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, h2::Error>>> {
        let this = &mut *self;
        if !this.data_done {
            match std::task::ready!(this.recv.poll_data(cx)) {
                Some(Ok(data)) => {
                    // The window reopens as the caller reads, never before: a caller that
                    // stops reading stops the upstream at its window.
                    let _ = this.recv.flow_control().release_capacity(data.len());
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                Some(Err(e)) => return Poll::Ready(ended_early(e)),
                None => this.data_done = true,
            }
        }
        match std::task::ready!(this.recv.poll_trailers(cx)) {
            Ok(Some(trailers)) => Poll::Ready(Some(Ok(Frame::trailers(trailers)))),
            Ok(None) => Poll::Ready(None),
            Err(e) => Poll::Ready(ended_early(e)),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.recv.is_end_stream()
    }

    /// Nothing left once the stream has ended, else unknown: a declared length travels in
    /// the answer's head, which the proxy passes on.
    fn size_hint(&self) -> SizeHint {
        if self.recv.is_end_stream() {
            SizeHint::with_exact(0)
        } else {
            SizeHint::default()
        }
    }
}
