use super::*;

#[test]
fn plain_selectors_are_recognised_and_nothing_else() {
    let m = selector(r#" rpc_rps{service="shop", caller=~"web|api",procedure!='x\'y'} "#).unwrap();
    let got: Vec<_> = m
        .iter()
        .map(|m| (m.name.as_str(), m.op, m.value.as_str()))
        .collect();
    assert_eq!(
        got,
        [
            ("__name__", "=", "rpc_rps"),
            ("service", "=", "shop"),
            ("caller", "=~", "web|api"),
            ("procedure", "!=", "x'y"),
        ]
    );
    assert_eq!(selector("job:rpc_rps:rate1m").unwrap().len(), 1);
    assert_eq!(
        selector(r#"{service="shop", caller!="x"}"#).unwrap().len(),
        2
    );
    assert_eq!(selector("{__name__=`a\\b`,}").unwrap()[0].value, "a\\b");
    for q in [
        "",
        "{}",
        "rate(x[1m])",
        "sum by (service) (x)",
        "x offset 5m",
        "x[5m]",
        "x * 2",
        "x{a=\"b\"",
        "x{a=b}",
        "x{a=\"\\q\"}",
        "x{1a=\"b\"}",
        "x y",
        // PromQL refuses these (no matcher that excludes the empty string, the name
        // twice, a keyword, an escape of the other quote), or they select every series.
        "{caller!=\"x\"}",
        "{a=~\".*\"}",
        "{a=\"\"}",
        "x{__name__=\"y\"}",
        "sum",
        "Inf",
        "x{a=\"\\'\"}",
        "\u{a0}x",
    ] {
        assert!(selector(q).is_none(), "{q:?} taken for a selector");
    }
}

use super::bench::encode;

#[test]
fn xor_chunks_decode_to_their_samples() {
    // Regular steps, jitter of every width, a large jump, negative dods, equal values,
    // values differing in every bit, NaN, the stale marker.
    let mut s = vec![(1_700_000_000_000i64, 12.5f64)];
    let gaps = [
        60_000,
        60_000,
        60_013,
        59_990,
        65_000,
        10,
        70_000,
        600_000,
        1,
        4_000_000_000,
        60_000,
    ];
    let vals = [
        12.5,
        13.0,
        -1e300,
        0.0,
        1e-300,
        f64::NAN,
        7.25,
        7.25,
        f64::from_bits(STALE_NAN),
        3.0,
        f64::MAX,
    ];
    for (g, v) in gaps.iter().zip(vals) {
        let t = s.last().unwrap().0 + g;
        s.push((t, v));
    }
    // Every delta-of-delta width at its bounds, and values differing in all 64 bits.
    let mut d = 60_000i64;
    let mut v = 1.0f64;
    for dod in [
        8192, -8191, 8193, 65_536, -65_535, 65_537, 524_288, -524_287, 524_289, -600_000,
    ] {
        d += dod;
        v = if v == 1.0 {
            -1.000_000_000_000_000_2
        } else {
            1.0
        };
        let t = s.last().unwrap().0 + d;
        s.push((t, v));
    }
    let mut out = Vec::new();
    decode_xor(&encode(&s), &mut out).unwrap();
    let bits = |v: &[(i64, f64)]| v.iter().map(|&(t, x)| (t, x.to_bits())).collect::<Vec<_>>();
    assert_eq!(bits(&out), bits(&s));
    // A random walk of 120 samples, as a TSDB chunk holds.
    let mut x = 100.0f64;
    let walk: Vec<_> = (0..120)
        .map(|k| {
            x = (x * (1.0 + ((k * 7919 % 13) as f64 - 6.0) / 100.0) * 1000.0).round() / 1000.0;
            (k as i64 * 60_000 + (k % 3) as i64, x)
        })
        .collect();
    out.clear();
    decode_xor(&encode(&walk), &mut out).unwrap();
    assert_eq!(bits(&out), bits(&walk));
    // Cut short: an error, not garbage.
    let enc = encode(&walk);
    out.clear();
    assert!(decode_xor(&enc[..enc.len() / 2], &mut out).is_err());
}

#[test]
fn steps_take_the_newest_sample_within_the_lookback() {
    let st = f64::from_bits(STALE_NAN);
    // Samples (ms): 30 s before step 60, at step 120, then a stale marker, then a gap.
    let samples = [(30_000, 1.0), (120_000, 2.0), (150_000, st), (400_000, 4.0)];
    let mut out = Vec::new();
    at_steps(
        &samples,
        Steps {
            from: 0,
            to: 720,
            step: 60,
            lookback_ms: 300_000,
            include_start: true,
        },
        &mut out,
    );
    assert_eq!(
        out,
        [
            (60.0, 1.0),
            (120.0, 2.0),
            (420.0, 4.0),
            (480.0, 4.0),
            (540.0, 4.0),
            (600.0, 4.0),
            (660.0, 4.0)
        ] // 720: the sample is 320 s old, past the lookback.
    );
    // The window includes its start before Prometheus 3: 400 s + 300 s = 700 s still
    // holds; from Prometheus 3 on it does not.
    for (include_start, want) in [(true, vec![(700.0, 4.0)]), (false, vec![])] {
        out.clear();
        let steps = Steps {
            from: 700,
            to: 701,
            step: 1,
            lookback_ms: 300_000,
            include_start,
        };
        at_steps(&samples, steps, &mut out);
        assert_eq!(out, want, "include_start {include_start}");
    }
    assert_eq!(prom_duration_ms("5m"), Some(300_000));
    assert_eq!(prom_duration_ms("1m30s"), Some(90_000));
    assert_eq!(prom_duration_ms("250ms"), Some(250));
    assert_eq!(prom_duration_ms("5x"), None);
}

#[test]
fn streamed_answers_go_on_the_grid() {
    let labels = |caller: &str| {
        let mut l = vec![("__name__".to_string(), "rpc_rps".to_string())];
        if !caller.is_empty() {
            l.push(("caller".into(), caller.into()));
        }
        l.push(("service".into(), "shop".into()));
        l
    };
    let samples = |k: f64| {
        (0..300)
            .map(|i| (i * 60_000, k + i as f64))
            .collect::<Vec<_>>()
    };
    // `web` falls step by step and comes in two frames (a series cut where Prometheus'
    // frame is full) with three samples missing at the cut: the steps there take the last
    // sample of the first frame, and the steps after the gap the second frame's samples,
    // which only holds if both frames are read as one series (a merge of separate parts
    // by maximum would keep the first frame's larger sample).
    let a: Vec<(i64, f64)> = (0..300)
        .filter(|i| !(130..133).contains(i))
        .map(|i| (i * 60_000, 1000.5 - i as f64))
        .collect();
    let b = samples(1000.25);
    let cut = a.iter().position(|s| s.0 >= 130 * 60_000).unwrap();
    let stale_long_ago = vec![(-3_600_000, 7.0)];
    let body = [
        bench::answer(&[(labels("web"), a[..cut].to_vec())]),
        bench::answer(&[
            (labels("web"), a[cut..].to_vec()),
            // no labels at all (a broken server): skipped, its samples go nowhere
            (vec![], vec![(0, 1e9), (60_000, 1e9)]),
            (labels("api"), b.clone()),
            // samples only before the range: no value at any step, no series
            (labels("old"), stale_long_ago),
        ]),
        bench::answer(&[(labels(""), b.clone())]),
    ]
    .concat();
    let builder = Arc::new(Mutex::new(Builder::new(0, 60, 300, Default::default())));
    let steps = Steps {
        from: 0,
        to: 299 * 60,
        step: 60,
        lookback_ms: 300_000,
        include_start: true,
    };
    let mut f = Frames::new(steps, builder.clone());
    // In pieces of 7 bytes: frames cut anywhere.
    for piece in body.chunks(7) {
        assert!(f.push(piece).is_continue());
    }
    f.finish().unwrap();
    let h = Arc::try_unwrap(builder)
        .ok()
        .unwrap()
        .into_inner()
        .unwrap()
        .finish();
    assert_eq!(h.series.len(), 2, "{:?}", h.series.keys());
    let web: Vec<f32> = (0..300)
        .map(|i: i64| {
            let i = if (130..133).contains(&i) { 129 } else { i };
            (1000.5 - i as f64) as f32
        })
        .collect();
    let api: Vec<f32> = b.iter().map(|x| x.1 as f32).collect();
    for (k, s) in &h.series {
        let want = if k.caller.as_deref() == Some("web") {
            &web
        } else {
            &api
        };
        assert_eq!(&s.values, want, "{k:?}");
    }
    assert_eq!(h.rejected.len(), 1, "the series without a caller");
    // Cut in the middle of a frame: an error.
    let mut f = Frames::new(
        steps,
        Arc::new(Mutex::new(Builder::new(0, 60, 300, Default::default()))),
    );
    assert!(f.push(&body[..body.len() - 3]).is_continue());
    assert!(f
        .finish()
        .unwrap_err()
        .to_string()
        .contains("inside a frame"));
    // Cut at a frame's end, the body not whole (a pull then never finishes the decoder):
    // the last series is not put on the grid.
    let cut = bench::answer(&[(labels("web"), a[..130].to_vec())]);
    let builder = Arc::new(Mutex::new(Builder::new(0, 60, 300, Default::default())));
    let mut f = Frames::new(steps, builder.clone());
    assert!(f.push(&cut).is_continue());
    drop(f);
    let h = Arc::try_unwrap(builder)
        .ok()
        .unwrap()
        .into_inner()
        .unwrap()
        .finish();
    assert!(h.series.is_empty(), "{:?}", h.series.keys());
}

#[test]
fn frames_are_checked() {
    let msg = proto::ChunkedReadResponse {
        chunked_series: vec![proto::ChunkedSeries {
            labels: vec![proto::Label {
                name: "a".into(),
                value: "b".into(),
            }],
            chunks: vec![],
        }],
        query_index: 0,
    }
    .encode_to_vec();
    let mut f = vec![msg.len() as u8];
    f.extend(crc32c::crc32c(&msg).to_be_bytes());
    f.extend(&msg);
    f.extend([5, 0, 0]); // the start of the next frame
    let (m, n) = frame(&f).unwrap().unwrap();
    assert_eq!((m, n), (&msg[..], 5 + msg.len()));
    assert_eq!(frame(&f[n..]).unwrap(), None, "incomplete");
    let mut bad = f.clone();
    bad[1] ^= 1;
    let e = frame(&bad).unwrap_err();
    assert_eq!(e, DecodeError::Checksum);
    assert!(e.to_string().contains("checksum"), "{e}");
    let e = frame(&[0xff, 0xff, 0xff, 0xff, 0x7f]).unwrap_err();
    assert!(matches!(e, DecodeError::FrameTooLarge(_)), "{e}");
    assert!(e.to_string().contains("bytes"), "{e}");
}

/// A frame around `msg`: length, CRC32C, message.
fn framed(msg: &[u8]) -> Vec<u8> {
    let mut f = Vec::new();
    prost::encoding::encode_varint(msg.len() as u64, &mut f);
    f.extend(crc32c::crc32c(msg).to_be_bytes());
    f.extend(msg);
    f
}

fn rps(caller: &str) -> Vec<(String, String)> {
    vec![
        ("__name__".into(), "rpc_rps".into()),
        ("caller".into(), caller.into()),
        ("service".into(), "shop".into()),
    ]
}

/// One series whose chunks keep coming (the same times again and again, with new values:
/// the newest of a millisecond wins), at one sample a second on a one-minute grid: the
/// decoder holds a bounded number of samples, and the steps get what they would get from
/// every sample kept.
#[test]
fn a_series_of_endless_chunks_holds_about_two_samples_per_step() {
    let steps = Steps {
        from: 0,
        to: 299 * 60,
        step: 60,
        lookback_ms: 300_000,
        include_start: true,
    };
    let mut all = Vec::new();
    let builder = Arc::new(Mutex::new(Builder::new(0, 60, 300, Default::default())));
    let mut f = Frames::new(steps, builder.clone());
    let mut most = 0;
    for rep in 0..20 {
        let samples: Vec<(i64, f64)> = (-400..18_100)
            .map(|k| {
                let v = if rep == 19 && k == 6_000 {
                    f64::from_bits(STALE_NAN)
                } else {
                    (rep * 1_000_000 + k) as f64
                };
                (k * 1_000, v)
            })
            .collect();
        all.extend(samples.iter().copied());
        for piece in bench::answer(&[(rps("web"), samples)]).chunks(4096) {
            assert!(f.push(piece).is_continue());
            most = most.max(f.samples.len());
        }
    }
    assert!(most <= f.compact_at + 120, "{most} samples held");
    f.finish().unwrap();
    // Every sample kept, in order of arrival, as before compaction.
    all.retain(|s| (-300_000..=299 * 60_000).contains(&s.0));
    all.sort_by_key(|s| s.0);
    let mut want = Vec::new();
    at_steps(&all, steps, &mut want);
    assert_eq!(want.len(), 299, "the stale step has no value");
    let h = Arc::try_unwrap(builder)
        .ok()
        .unwrap()
        .into_inner()
        .unwrap()
        .finish();
    let got = &h.series.values().next().unwrap().values;
    let mut expect = vec![f32::NAN; 300];
    for (t, v) in want {
        expect[t as usize / 60] = v as f32;
    }
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(got), bits(&expect));
}

/// Labels without end in one series: refused past [`LABELS_MAX`], nothing more read.
#[test]
fn labels_of_one_series_are_bounded() {
    let msg = proto::ChunkedReadResponse {
        chunked_series: vec![proto::ChunkedSeries {
            labels: (0..10_000)
                .map(|i| proto::Label {
                    name: format!("l{i}"),
                    value: "v".into(),
                })
                .collect(),
            chunks: vec![],
        }],
        query_index: 0,
    }
    .encode_to_vec();
    let b = Arc::new(Mutex::new(Builder::new(0, 60, 300, Default::default())));
    let steps = Steps {
        from: 0,
        to: 299 * 60,
        step: 60,
        lookback_ms: 300_000,
        include_start: true,
    };
    let mut f = Frames::new(steps, b);
    assert!(f.push(&framed(&msg)).is_break());
    assert!(f.push(b"more").is_break(), "nothing more is read");
    match f.finish() {
        Err(Bad::Exceeded(Bound::Labels(LABELS_MAX))) => {}
        e => panic!("{e:?}"),
    }
}

/// Fields are read where they lie: unknown ones are skipped, a wrong type or a length past
/// the end is an error, not a panic.
#[test]
fn frames_are_read_field_by_field() {
    let series = bench::answer(&[(rps("web"), vec![(0, 1.0), (60_000, 2.0)])]);
    let (msg, _) = frame(&series).unwrap().unwrap();
    // An unknown varint field and an unknown fixed64 field before the series.
    let mut odd = vec![3 << 3, 7, (4 << 3) | 1, 0, 0, 0, 0, 0, 0, 0, 0];
    odd.extend(msg);
    let b = Arc::new(Mutex::new(Builder::new(0, 60, 2, Default::default())));
    let steps = Steps {
        from: 0,
        to: 60,
        step: 60,
        lookback_ms: 300_000,
        include_start: true,
    };
    let mut f = Frames::new(steps, b.clone());
    assert!(f.push(&framed(&odd)).is_continue());
    f.finish().unwrap();
    let h = Arc::try_unwrap(b)
        .ok()
        .unwrap()
        .into_inner()
        .unwrap()
        .finish();
    assert_eq!(h.series.values().next().unwrap().values, [1.0, 2.0]);
    for bad in [
        vec![1 << 3, 5],            // series as a varint
        vec![(1 << 3) | 2, 200, 1], // a length past the end
        vec![(1 << 3) | 3],         // a group
        vec![(2 << 3), 0x80],       // a varint cut short
    ] {
        let b = Arc::new(Mutex::new(Builder::new(0, 60, 2, Default::default())));
        let mut f = Frames::new(steps, b);
        assert!(f.push(&framed(&bad)).is_break(), "{bad:?}");
        match f.finish() {
            Err(Bad::Unreadable(e @ Unreadable::Frame(_))) => {
                assert!(e.to_string().starts_with("undecodable frame"), "{e}")
            }
            e => panic!("{bad:?}: {e:?}"),
        }
    }
}

/// A series listed again and again (two series in turn) in a spilled pull of one request
/// and attempt: refused at its second listing.
#[test]
fn a_series_repeated_in_an_answer_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let b = Builder::spilled(0, 60, 300, Default::default(), dir.path())
        .unwrap()
        .bounded(1000, 1);
    let b = Arc::new(Mutex::new(b));
    let steps = Steps {
        from: 0,
        to: 299 * 60,
        step: 60,
        lookback_ms: 300_000,
        include_start: true,
    };
    let mut f = Frames::new(steps, b);
    let two = bench::answer(&[(rps("web"), vec![(0, 1.0)]), (rps("api"), vec![(0, 1.0)])]);
    let mut broke = false;
    for _ in 0..3 {
        broke = f.push(&two).is_break();
        if broke {
            break;
        }
    }
    assert!(broke);
    match f.finish() {
        Err(Bad::Exceeded(Bound::Repeated { series, max: 1 })) => {
            assert_eq!(series, "shop/web")
        }
        e => panic!("{e:?}"),
    }
}
