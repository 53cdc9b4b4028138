//! One h2c connection to the upstream, driven with the `h2` crate itself rather than through
//! hyper's HTTP/2 client: a call sends its head from its own task and waits there for the
//! answer, without hyper's dispatch task, its channel, the task it spawns per call to wait for
//! the answer and the one-shot channel that hands the answer back (8 % of the instructions of
//! a proxied gRPC call, docs/grl-sidecar-bench.md). The connection's own task reads and writes
//! the socket.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::Body;
use bytes::Bytes;
use http::{Request, Response};
use hyper::body::{Body as _, Frame, SizeHint};
use hyper_util::rt::TokioIo;

use crate::upstream::UpstreamIo;

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
pub(crate) struct H2Handle {
    tx: h2::client::SendRequest<Bytes>,
    /// Set when the connection's task has ended.
    closed: Arc<AtomicBool>,
    /// Held by every handle: when the last one is dropped, the connection's task wakes and
    /// lets the connection close once its calls have ended (h2 does not wake a connection
    /// parked with no I/O when its last `SendRequest` goes).
    _alive: tokio::sync::mpsc::Sender<Infallible>,
}

/// A connection's identity ([`H2Handle::id`]).
pub(crate) struct ConnId(Arc<AtomicBool>);

impl ConnId {
    /// Whether `h` is a handle on this connection.
    pub(crate) fn is(&self, h: &H2Handle) -> bool {
        Arc::ptr_eq(&self.0, &h.closed)
    }
}

impl H2Handle {
    /// The HTTP/2 handshake on `io`; the connection's task is spawned on this thread's
    /// runtime.
    pub(crate) async fn handshake(io: UpstreamIo) -> Result<H2Handle, h2::Error> {
        let (tx, conn) = h2::client::Builder::new()
            .initial_window_size(STREAM_WINDOW)
            .initial_connection_window_size(CONNECTION_WINDOW)
            .initial_max_send_streams(INITIAL_MAX_SEND_STREAMS)
            .max_header_list_size(MAX_HEADER_LIST)
            .max_send_buffer_size(MAX_SEND_BUFFER)
            .enable_push(false)
            .handshake::<_, Bytes>(TokioIo::new(io))
            .await?;
        let closed = Arc::new(AtomicBool::new(false));
        let (alive, mut gone) = tokio::sync::mpsc::channel::<Infallible>(1);
        let ended = closed.clone();
        tokio::spawn(async move {
            tokio::pin!(conn);
            let r = tokio::select! {
                r = &mut conn => r,
                // Every handle dropped: the connection closes once its streams end.
                _ = gone.recv() => conn.await,
            };
            ended.store(true, Ordering::Relaxed);
            if let Err(e) = r {
                tracing::debug!(error = %e, "upstream h2c connection ended with an error");
            }
        });
        Ok(H2Handle {
            tx,
            closed,
            _alive: alive,
        })
    }

    /// Whether the connection's task has ended (its calls all failed or finished).
    pub(crate) fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Relaxed)
    }

    /// Which connection this is, without holding it open.
    pub(crate) fn id(&self) -> ConnId {
        ConnId(self.closed.clone())
    }

    /// Sends one call and waits for its answer's head; `Err(req)` when the connection takes
    /// no new stream (it closed, or the upstream sent GOAWAY): nothing was sent.
    pub(crate) async fn send(
        self,
        req: Request<Body>,
    ) -> Result<Result<Response<H2Body>, h2::Error>, Request<Body>> {
        let tx = match self.tx.ready().await {
            Ok(tx) => tx,
            Err(_) => return Err(req),
        };
        Ok(send_ready(tx, req).await)
    }
}

/// [`H2Handle::send`] once the connection takes a stream.
async fn send_ready(
    mut tx: h2::client::SendRequest<Bytes>,
    req: Request<Body>,
) -> Result<Response<H2Body>, h2::Error> {
    let (mut head, body) = req.into_parts();
    // HTTP/2 forbids the connection-specific headers, and h2 refuses a call with one: gone,
    // with `TE` other than `trailers` (a scan of the names when there are none, as from the
    // proxy, which has removed them already).
    crate::strip_hop_by_hop(&mut head.headers);
    let eos = body.is_end_stream();
    let (answer, stream) = tx.send_request(Request::from_parts(head, ()), eos)?;
    drop(tx);
    let mut pipe = (!eos).then(|| Pipe { body, tx: stream });
    let mut answer = answer;
    // The body goes while the answer is awaited: a small one ends in the first poll.
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
    .await;
    // A body still streaming (a client-streaming call answered early) goes on in a task of
    // its own, as long as the call's stream lives.
    if let Some(p) = pipe {
        tokio::spawn(async move {
            if let Err(e) = p.await {
                tracing::debug!(error = %e, "gRPC request body to the upstream failed");
            }
        });
    }
    let (parts, recv) = head?.into_parts();
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
}

impl Future for Pipe {
    type Output = Result<(), h2::Error>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        loop {
            // Room for at least a byte before the next frame is read: what the upstream has
            // not taken stays in the caller's body, not in the sidecar (h2 queues a frame
            // larger than the window, up to its send buffer).
            this.tx.reserve_capacity(1);
            if this.tx.capacity() == 0 {
                loop {
                    match std::task::ready!(this.tx.poll_capacity(cx)) {
                        Some(Ok(0)) => {}
                        Some(Ok(_)) => break,
                        Some(Err(e)) => return Poll::Ready(Err(e)),
                        // No longer open for sending: ended or reset.
                        None => return Poll::Ready(Err(h2::Error::from(h2::Reason::CANCEL))),
                    }
                }
            } else if let Poll::Ready(reason) = this.tx.poll_reset(cx)? {
                return Poll::Ready(Err(h2::Error::from(reason)));
            }
            match std::task::ready!(Pin::new(&mut this.body).poll_frame(cx)) {
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) => {
                        let eos = this.body.is_end_stream();
                        this.tx.send_data(data, eos)?;
                        if eos {
                            return Poll::Ready(Ok(()));
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
                    tracing::debug!(error = %e, "the caller's gRPC request body failed");
                    this.tx.send_reset(h2::Reason::INTERNAL_ERROR);
                    return Poll::Ready(Err(h2::Error::from(h2::Reason::INTERNAL_ERROR)));
                }
                None => {
                    this.tx.send_data(Bytes::new(), true)?;
                    return Poll::Ready(Ok(()));
                }
            }
        }
    }
}

/// An answer's body from the upstream: its data, each piece's window given back as the caller
/// takes it, then its trailers (a gRPC call's status).
pub struct H2Body {
    recv: h2::RecvStream,
    data_done: bool,
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
                Some(Err(e)) => return Poll::Ready(Some(Err(e))),
                None => this.data_done = true,
            }
        }
        match std::task::ready!(this.recv.poll_trailers(cx)) {
            Ok(Some(trailers)) => Poll::Ready(Some(Ok(Frame::trailers(trailers)))),
            Ok(None) => Poll::Ready(None),
            Err(e) => Poll::Ready(Some(Err(e))),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.recv.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}
