//! `GrlLayer::concurrency_limit`: the wrapped service never has more requests in flight than
//! the limit; the more critical request waiting gets the next slot; a SHEDDABLE one starts
//! only while half the slots are free; one that finds no slot in time is answered 503 with
//! `Retry-After` and never reaches the service.

use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use grl_client::concurrency::{Mode, Options};
use grl_client::layer::GrlLayer;
use grl_core::Limiter;
use tower::{Layer, ServiceExt};

#[tokio::test(start_paused = true)]
async fn the_layer_holds_the_service_to_its_slots() {
    let limiter = Arc::new(Limiter::new("svc", Duration::from_secs(3)));
    let layer = GrlLayer::new(limiter).concurrency_limit(Options {
        mode: Mode::Fixed(2),
        queue_timeout: Duration::from_millis(150),
        ..Options::default()
    });
    // A service taking 100 ms a request, recording how many it works on at once and in
    // which order the requests reached it.
    let busy = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let order = Arc::new(std::sync::Mutex::new(Vec::new()));
    let svc = layer.layer(tower::service_fn({
        let (busy, most, order) = (busy.clone(), most.clone(), order.clone());
        move |req: http::Request<()>| {
            let (busy, most, order) = (busy.clone(), most.clone(), order.clone());
            async move {
                let now = busy.fetch_add(1, Ordering::SeqCst) + 1;
                most.fetch_max(now, Ordering::SeqCst);
                order.lock().unwrap().push(req.uri().path().to_string());
                tokio::time::sleep(Duration::from_millis(100)).await;
                busy.fetch_sub(1, Ordering::SeqCst);
                Ok::<_, Infallible>(http::Response::new(String::from("ok")))
            }
        }
    }));
    let send = |path: &str, tier: &str| {
        let req = http::Request::builder()
            .uri(path)
            .header("rpc-criticality", tier)
            .body(())
            .unwrap();
        let svc = svc.clone();
        tokio::spawn(async move { svc.oneshot(req).await.unwrap() })
    };
    // Two take the slots; a SHEDDABLE one and then a CRITICAL one wait; the CRITICAL one
    // gets the first free slot (at 100 ms). SHEDDABLE starts only while fewer than half the
    // slots are busy, which the CRITICAL one keeps them until 200 ms: past its 150 ms, so it
    // is refused without reaching the service.
    let a = send("/a", "CRITICAL");
    let b = send("/b", "CRITICAL");
    tokio::task::yield_now().await;
    let s = send("/s", "SHEDDABLE");
    tokio::task::yield_now().await;
    let c = send("/c", "CRITICAL");
    tokio::task::yield_now().await;
    for h in [a, b, c] {
        assert_eq!(h.await.unwrap().status(), 200);
    }
    let s = s.await.unwrap();
    assert_eq!(s.status(), 503);
    assert_eq!(s.headers()["retry-after"], "1");
    assert_eq!(s.into_body(), "overloaded\n");
    // Idle again: a SHEDDABLE request goes straight through.
    assert_eq!(send("/late", "SHEDDABLE").await.unwrap().status(), 200);
    assert_eq!(most.load(Ordering::SeqCst), 2);
    let order = order.lock().unwrap().clone();
    assert_eq!(
        order,
        ["/a", "/b", "/c", "/late"],
        "CRITICAL first, /s never"
    );
    let stats = layer.concurrency().unwrap().stats();
    assert_eq!(stats.in_flight.load(Ordering::SeqCst), 0);
    assert_eq!(stats.refused[0][0].load(Ordering::SeqCst), 1);
}
