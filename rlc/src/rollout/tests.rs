//! Tests of the rollouts: the state machine alone, and driven through a store.

use super::driver::*;
use super::state::*;
use super::*;

mod pure {
    use super::*;

    /// A rollout stored before `stage_began_ms` existed: its stage began when its candidate
    /// first reached a controller, else (pending: its row is written only when the stage
    /// begins) at its last change; so a stage pending since before an upgrade still ends.
    #[test]
    fn a_row_stored_before_stage_began_existed_begins_its_stage_at_its_last_change() {
        let r = Rollout {
            change: "lowered 3470 -> 100 rps".into(),
            stages: vec![vec!["eu".into()]],
            stage_started_ms: None,
            updated_ms: 5_000,
            rev: Some(3),
            ..staged(100.0, 1_000)
        };
        assert_eq!(r.stage_began(), 1_000);
        let mut doc = serde_json::to_value(&r).unwrap();
        doc.as_object_mut().unwrap().remove("stage_began_ms");
        assert!(
            doc.get("rev").is_none(),
            "the revision is the row's, not the document's"
        );
        let old: Rollout = serde_json::from_value(doc).unwrap();
        assert_eq!(old.stage_began_ms, None);
        assert_eq!(old.stage_began(), 5_000);
        let reached = Rollout {
            stage_started_ms: Some(4_000),
            ..old
        };
        assert_eq!(reached.stage_began(), 4_000);
    }

    /// A rollout of pay/gw from 3,470 to `limit` rps baking in stages `eu` then `us` since
    /// `t0` (its candidate on eu's controller since then).
    fn staged(limit: f64, t0: i64) -> Rollout {
        Rollout {
            id: "rlc-1".into(),
            service: "pay".into(),
            bucket: "gw".into(),
            old: Some(crate::gitops::tests::planned("pay", "gw", 3470.0).bucket),
            new: crate::gitops::tests::planned("pay", "gw", limit).bucket,
            change: "lowered".into(),
            version: "abc".into(),
            settings: schema::RolloutSpec::default().resolved(),
            stages: vec![vec!["eu".into()], vec!["us".into()]],
            stage: 0,
            stage_started_ms: Some(t0),
            stage_began_ms: Some(t0),
            state: RolloutState::Baking,
            reason: None,
            fingerprint: "fp".into(),
            created_ms: t0,
            updated_ms: t0,
            figures: StageFigures::default(),
            revert: None,
            revert_pending: false,
            settled: false,
            fleet: None,
            rev: Some(0),
        }
    }

    /// The state machine alone, without a store: one judgement of a stage on its counts.
    #[test]
    fn a_stage_is_promoted_aborted_or_left_alone_on_its_counts() {
        let t0 = 1_000_000;
        let r = staged(100.0, t0);
        let bake_ms = r.settings.bake.as_millis() as i64;
        let at = |ms: i64, seconds: f64, rps: f64, dropped: f64| CountRow {
            updated_ms: ms,
            ..count("eu", "e1", seconds, rps, dropped)
        };
        // Baked long enough, nothing the candidate would refuse: on to the next stage.
        let now = t0 + bake_ms + 1_000;
        let secs = (bake_ms / 1000 + 1) as f64;
        let Judgement {
            rollout: next,
            transition: t,
            ..
        } = judge_stage(&r, &[at(now, secs, 50.0, 0.0)], now).unwrap();
        assert_eq!(
            t,
            Some(Transition::Promoted {
                id: "rlc-1".into(),
                stage: 1
            })
        );
        assert_eq!((next.stage, next.state), (1, RolloutState::Baking));
        assert_eq!(
            next.figures,
            StageFigures::default(),
            "the next stage counts afresh"
        );
        assert_eq!(next.current_regions(), ["us"]);
        // The candidate would refuse a third of what eu offered: aborted, with the evidence.
        let Judgement {
            rollout: next,
            transition: t,
            ..
        } = judge_stage(&r, &[at(now, secs, 150.0, 50.0 * secs)], now).unwrap();
        assert_eq!(t, Some(Transition::Aborted("rlc-1".into())));
        assert_eq!(next.state, RolloutState::Aborted);
        assert!(next.revert_pending);
        let why = next.reason.unwrap();
        assert!(why.contains("in region eu"), "{why}");
        // Early in the bake, the same figures as stored: nothing to write.
        let early = t0 + 1_000;
        let counts = [at(early, 1.0, 50.0, 0.0)];
        let Judgement {
            rollout: seen,
            transition: t,
            ..
        } = judge_stage(&r, &counts, early).unwrap();
        assert_eq!(t, None, "new figures are stored, nothing judged yet");
        assert!(judge_stage(&seen, &counts, early).is_none());
        // Counts a poll old (eu's controller not read now) cover nothing: never promoted.
        let (next, t) = judge_stage(&r, &[at(now - 1, secs, 50.0, 0.0)], now)
            .map_or((r.clone(), None), |j| (j.rollout, j.transition));
        assert_eq!(t, None);
        assert_eq!(next.stage, 0);
    }

    pub(super) fn gw(scope: Scope, limit: f64) -> Bucket {
        Bucket {
            scope,
            ..crate::gitops::tests::planned("payments", "gw", limit).bucket
        }
    }

    pub(super) fn regions(names: &[&str]) -> Vec<String> {
        names.iter().map(|s| s.to_string()).collect()
    }

    /// Cumulative counts of one controller process: `rps` offered for `seconds`, `own`
    /// virtually dropped by its own counting.
    fn count(region: &str, epoch: &str, seconds: f64, rps: f64, own: f64) -> CountRow {
        CountRow {
            rollout_id: "rlc-1".into(),
            region: region.into(),
            epoch: epoch.into(),
            seconds,
            offered: rps * seconds,
            virtual_dropped: own,
            enforced_dropped: 0.0,
            updated_ms: 0,
        }
    }

    /// Which `global` candidates each controller counts on its own region only: a new bucket,
    /// a scope widened to `global`, another caller; not a `global` bucket of the same match
    /// (its peers' sums are part of it), nor a narrower scope.
    #[test]
    fn a_global_candidate_counted_per_region_is_judged_on_the_fleet() {
        let global = gw(Scope::Global, 1000.0);
        assert!(judged_on_fleet(None, &global));
        assert!(judged_on_fleet(Some(&gw(Scope::Region, 3470.0)), &global));
        assert!(judged_on_fleet(Some(&gw(Scope::Zone, 3470.0)), &global));
        let other_caller = Bucket {
            caller: Some("web".into()),
            ..gw(Scope::Global, 3470.0)
        };
        assert!(judged_on_fleet(Some(&other_caller), &global));
        assert!(!judged_on_fleet(Some(&gw(Scope::Global, 3470.0)), &global));
        let shadow = Bucket {
            mode: schema::Mode::Shadow,
            ..gw(Scope::Global, 1000.0)
        };
        assert!(!judged_on_fleet(Some(&shadow), &global));
        assert!(!judged_on_fleet(None, &gw(Scope::Region, 1000.0)));
        // One region's counts are the fleet's.
        assert!(!on_fleet(None, &global, &regions(&["eu"])));
        assert!(on_fleet(None, &global, &regions(&["a", "b"])));
    }

    /// Three regions at 600 rps each against a global 1,000: every controller alone saw no
    /// virtual drop (600 < 1,000), which summed as counts passes the stage; on the regions'
    /// summed rate (1,800) the candidate refuses 800 of every 1,800 requests.
    #[test]
    fn three_regions_under_a_global_limit_alone_are_judged_on_their_rate_summed() {
        let abc = regions(&["a", "b", "c"]);
        let counts: Vec<CountRow> = ["a", "b", "c"]
            .iter()
            .map(|r| count(r, "e1", 10.0, 600.0, 0.0))
            .collect();
        let (t, f) = fleet_step(&FleetTally::default(), &counts, &abc, 1000.0);
        assert_eq!(f.offered, 18_000.0);
        assert!((f.share() - 800.0 / 1800.0).abs() < 1e-9, "{f:?}");
        assert_eq!(
            (t.offered, t.virtual_dropped),
            (f.offered, f.virtual_dropped)
        );
        assert_eq!(t.marks.len(), 3);
        // The next interval adds only what came since: 10 s more at 300 rps each (900 < 1,000).
        let later: Vec<CountRow> = ["a", "b", "c"]
            .iter()
            .map(|r| CountRow {
                offered: 6000.0 + 3000.0,
                ..count(r, "e1", 20.0, 0.0, 0.0)
            })
            .collect();
        let (t2, f2) = fleet_step(&t, &later, &abc, 1000.0);
        assert_eq!(f2.offered, 27_000.0);
        assert!(
            (f2.virtual_dropped - f.virtual_dropped).abs() < 1e-9,
            "{f2:?}"
        );
        assert_eq!(t2.marks[0].seconds, 20.0);
    }

    /// Without every region's counts since the last interval no fleet rate is taken: the
    /// marks stay and the figures add the regions' own virtual drops only; once the silent
    /// region's counts arrive, the whole interval is taken at the fleet's rate. A controller
    /// restarted (a new epoch) counts from zero; a process counting from zero again is taken
    /// from zero.
    #[test]
    fn the_fleet_rate_waits_for_every_region() {
        let abc = regions(&["a", "b", "c"]);
        let two = vec![
            count("a", "e1", 10.0, 600.0, 0.0),
            count("b", "e1", 10.0, 600.0, 0.0),
        ];
        let (t, f) = fleet_step(&FleetTally::default(), &two, &abc, 1000.0);
        assert_eq!(t, FleetTally::default());
        assert_eq!((f.offered, f.virtual_dropped), (12_000.0, 0.0));
        let mut all = two.clone();
        all.push(count("c", "e1", 10.0, 600.0, 0.0));
        let (t, f) = fleet_step(&t, &all, &abc, 1000.0);
        assert!((f.share() - 800.0 / 1800.0).abs() < 1e-9, "{f:?}");
        // b restarted: its old process's counts stay, a new one counts 10 s; c's process
        // counts from zero again (5 s).
        let mut next = vec![
            count("a", "e1", 20.0, 600.0, 0.0),
            count("b", "e1", 10.0, 600.0, 0.0),
            count("b", "e2", 10.0, 600.0, 0.0),
            count("c", "e1", 5.0, 600.0, 0.0),
        ];
        let (t2, f2) = fleet_step(&t, &next, &abc, 1000.0);
        assert_eq!(f2.offered, 18_000.0 + 6000.0 + 6000.0 + 3000.0);
        assert!((f2.share() - 800.0 / 1800.0).abs() < 1e-9, "{f2:?}");
        // A region's own virtual drops above the fleet estimate (a peak its controller saw
        // tick by tick within the interval) count.
        next = t2
            .marks
            .iter()
            .map(|m| CountRow {
                seconds: m.seconds + 10.0,
                offered: m.offered + 1000.0,
                virtual_dropped: m.virtual_dropped + if m.region == "a" { 700.0 } else { 0.0 },
                ..count(&m.region, &m.epoch, 0.0, 0.0, 0.0)
            })
            .collect();
        let (_, f3) = fleet_step(&t2, &next, &abc, 1000.0);
        assert!(
            (f3.virtual_dropped - f2.virtual_dropped - 700.0).abs() < 1e-9,
            "{f3:?}"
        );
    }

    /// A rollout of a global candidate counted per region started before rlc judged such
    /// candidates on the fleet (two stages, the first passed): superseded by a rollout of the
    /// same change as one stage of every region, judged on their sum, its bake afresh; the
    /// region whose stage had passed goes back to the spec in force with the candidate.
    #[tokio::test]
    async fn a_staged_rollout_of_a_global_candidate_is_restarted_as_one_stage_of_every_region() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::connect("sqlite://rlc.db", dir.path()).await.unwrap();
        let old = gw(Scope::Region, 3470.0);
        let new = gw(Scope::Global, 1000.0);
        let mut staged = Rollout {
            id: "rlc-staged".into(),
            service: "payments".into(),
            bucket: "gw".into(),
            old: Some(old.clone()),
            new: new.clone(),
            change: change_words(Some(&old), &new),
            version: "v2".into(),
            settings: schema::RolloutSpec::default().resolved(),
            stages: vec![regions(&["a"]), regions(&["b", "c"])],
            stage: 1,
            stage_started_ms: Some(2_000),
            stage_began_ms: Some(2_000),
            state: RolloutState::Baking,
            reason: None,
            fingerprint: "fp".into(),
            created_ms: 1_000,
            updated_ms: 2_000,
            figures: StageFigures::default(),
            revert: None,
            revert_pending: false,
            settled: false,
            fleet: None,
            rev: None,
        };
        assert!(save(&store, &mut staged).await.unwrap());
        let doc = ConfigDoc {
            version: "v2".into(),
            services: vec![BucketFile {
                criticality: Default::default(),
                service: "payments".into(),
                buckets: vec![new.clone()],
            }],
            ..Default::default()
        };
        let base = BaseInput {
            doc: &doc,
            policies: None,
            inputs: "in",
        };
        let abc = regions(&["a", "b", "c"]);
        let now = Utc::now();
        let open = account(&store, &abc, &base, now).await.unwrap();
        assert_eq!(open.len(), 1, "{open:?}");
        let r = &open[0];
        assert_ne!(r.id, staged.id);
        assert_eq!(r.stages, vec![abc.clone()]);
        assert_eq!((r.stage, r.stage_started_ms), (0, None));
        assert_eq!(r.fleet, Some(FleetTally::default()));
        assert_eq!((r.old.as_ref(), &r.new), (Some(&old), &new));
        let gone = Rollout::from_row(
            &store
                .recent_rollouts(Some(("payments", "gw")), 10)
                .await
                .unwrap()
                .into_iter()
                .find(|x| x.id == "rlc-staged")
                .unwrap(),
        )
        .unwrap();
        assert_eq!(gone.state, RolloutState::Superseded);
        assert!(gone
            .reason
            .unwrap()
            .starts_with("restarted as one stage of every region"));
        let a = desired_for("a", &doc, &open);
        assert_eq!(a.services[0].buckets[0], old, "back to the spec in force");
        assert_eq!(a.candidates.len(), 1);
        assert_eq!(a.candidates[0].id, r.id);
        // Accounted again: nothing changes.
        let again = account(&store, &abc, &base, now).await.unwrap();
        assert_eq!(again[0].id, r.id);
    }
}

mod fix_tests {
    //! The restart, judgement and coverage of rollouts judged on the fleet.
    use super::pure::{gw, regions};
    use super::*;

    /// A baking rollout of payments/gw from a `region` 3,470 to a `global` 1,000 over
    /// `stages`, begun (and its candidate on the controllers) at `t0`, judged on the fleet
    /// when `fleet`; its id is the one [`account`] gives it.
    fn baking(stages: &[&[&str]], fleet: bool, t0: i64) -> Rollout {
        let old = gw(Scope::Region, 3470.0);
        let new = gw(Scope::Global, 1000.0);
        let all: Vec<String> = stages.concat().iter().map(|s| s.to_string()).collect();
        Rollout {
            id: rollout_id(
                "payments",
                "gw",
                Some(&old),
                &new,
                "v2",
                fleet.then_some(all.as_slice()),
            ),
            service: "payments".into(),
            bucket: "gw".into(),
            change: change_words(Some(&old), &new),
            old: Some(old),
            new,
            version: "v2".into(),
            settings: schema::RolloutSpec::default().resolved(),
            stages: stages.iter().map(|s| regions(s)).collect(),
            stage: 0,
            stage_started_ms: Some(t0),
            stage_began_ms: Some(t0),
            state: RolloutState::Baking,
            reason: None,
            fingerprint: "fp".into(),
            created_ms: t0,
            updated_ms: t0,
            figures: StageFigures::default(),
            revert: None,
            revert_pending: false,
            settled: false,
            fleet: fleet.then(FleetTally::default),
            rev: None,
        }
    }

    fn doc() -> ConfigDoc {
        ConfigDoc {
            version: "v2".into(),
            services: vec![BucketFile {
                criticality: Default::default(),
                service: "payments".into(),
                buckets: vec![gw(Scope::Global, 1000.0)],
            }],
            ..Default::default()
        }
    }

    async fn store(dir: &tempfile::TempDir) -> Store {
        Store::connect("sqlite://rlc.db", dir.path()).await.unwrap()
    }

    /// `account` over the controllers' `regions` at `t` ms (the base already accounted).
    async fn account_at(store: &Store, names: &[&str], t: i64) -> Vec<Rollout> {
        let d = doc();
        let base = BaseInput {
            doc: &d,
            policies: None,
            inputs: "in",
        };
        account(store, &regions(names), &base, ms_time(t).unwrap())
            .await
            .unwrap()
    }

    /// What the store holds open, read afresh (what the next poll works on).
    async fn reread(store: &Store) -> Vec<Rollout> {
        open(store).await.unwrap()
    }

    const T0: i64 = 1_800_000_000_000;

    /// A restart whose id is already stored — the regions went {a,b,c} -> {a,b} -> {a,b,c}
    /// during the bake, or an older rlc re-saved the row without `fleet` — still leaves the
    /// change baking in the store: the controllers keep the spec in force, the candidate
    /// beside it, and the change is never served un-gated.
    #[tokio::test]
    async fn a_restart_onto_an_id_already_stored_leaves_the_change_baking() {
        let old = gw(Scope::Region, 3470.0);
        // Regions {a,b,c} -> {a,b} -> {a,b,c}.
        let dir = tempfile::tempdir().unwrap();
        let st = store(&dir).await;
        let mut first = baking(&[&["a", "b", "c"]], true, T0);
        assert!(save(&st, &mut first).await.unwrap());
        let two = account_at(&st, &["a", "b"], T0 + 60_000).await;
        assert_eq!(two.len(), 1);
        assert_eq!(two[0].stages, vec![regions(&["a", "b"])]);
        account_at(&st, &["a", "b", "c"], T0 + 120_000).await;
        let open = reread(&st).await;
        assert_eq!(open.len(), 1, "{open:?}");
        let r = &open[0];
        assert_eq!(r.state, RolloutState::Baking);
        assert_eq!(r.stages, vec![regions(&["a", "b", "c"])]);
        assert_eq!(r.fleet, Some(FleetTally::default()));
        assert!(r.id != first.id && r.id != two[0].id, "{}", r.id);
        let a = desired_for("a", &doc(), &open);
        assert_eq!(a.services[0].buckets[0], old, "the spec in force stays");
        assert_eq!(a.candidates.len(), 1);
        // Accounted again: the same rollout.
        account_at(&st, &["a", "b", "c"], T0 + 180_000).await;
        assert_eq!(reread(&st).await[0].id, r.id);

        // An older rlc re-saved the row without `fleet`: the restart rebuilds its own id.
        let dir = tempfile::tempdir().unwrap();
        let st = store(&dir).await;
        let mut resaved = baking(&[&["a", "b", "c"]], true, T0);
        resaved.fleet = None;
        assert!(save(&st, &mut resaved).await.unwrap());
        account_at(&st, &["a", "b", "c"], T0 + 60_000).await;
        let open = reread(&st).await;
        assert_eq!(open.len(), 1, "{open:?}");
        assert_eq!(open[0].state, RolloutState::Baking);
        assert_ne!(open[0].id, resaved.id);
        assert_eq!(open[0].fleet, Some(FleetTally::default()));
        assert_eq!(desired_for("b", &doc(), &open).services[0].buckets[0], old);
    }
    /// The counts `region`'s controller reported at `at` ms: `rps` for `seconds`, no
    /// virtual drop.
    async fn counted(store: &Store, id: &str, region: &str, seconds: f64, rps: f64, at: i64) {
        store
            .record_candidate_counts(&[CountRow {
                rollout_id: id.into(),
                region: region.into(),
                epoch: "e1".into(),
                seconds,
                offered: rps * seconds,
                virtual_dropped: 0.0,
                enforced_dropped: 0.0,
                updated_ms: at,
            }])
            .await
            .unwrap();
    }

    /// A rollout that must be judged on the fleet but has no `fleet` (baking in stages when
    /// rlc was upgraded, not restarted yet: the push that restarts it comes after the
    /// judgement, and is skipped while the config repo cannot be read) is never promoted on
    /// its stage's own counts.
    #[tokio::test]
    async fn a_rollout_to_be_judged_on_the_fleet_without_fleet_is_never_promoted() {
        let dir = tempfile::tempdir().unwrap();
        let st = store(&dir).await;
        let mut staged = baking(&[&["a"], &["b", "c"]], false, T0);
        assert!(save(&st, &mut staged).await.unwrap());
        // Region a alone offers 600 rps for the whole bake: no virtual drop at 1,000.
        let now = T0 + 3_700_000;
        counted(&st, &staged.id, "a", 3700.0, 600.0, now).await;
        let mut open = reread(&st).await;
        let out = judge(&st, &mut open, ms_time(now).unwrap()).await.unwrap();
        assert_eq!(out, vec![], "{open:?}");
        let r = &reread(&st).await[0];
        assert_eq!((r.state, r.stage), (RolloutState::Baking, 0));
        // Once restarted as one stage of every region it is judged (control: the same counts
        // of every region pass).
        let mut single = baking(&[&["a"]], false, T0);
        single.id = "rlc-one".into();
        assert!(save(&st, &mut single).await.unwrap());
        counted(&st, "rlc-one", "a", 3700.0, 600.0, now).await;
        let mut open = vec![single];
        let out = judge(&st, &mut open, ms_time(now).unwrap()).await.unwrap();
        assert_eq!(out, vec![Transition::Done("rlc-one".into())]);
    }
    /// A region whose controller went silent after covering 92 % of the bake does not let the
    /// stage pass on its stored seconds: every region's counts must be current.
    #[tokio::test]
    async fn a_region_gone_silent_holds_the_stage() {
        let dir = tempfile::tempdir().unwrap();
        let st = store(&dir).await;
        let mut r = baking(&[&["a", "b", "c"]], true, T0);
        assert!(save(&st, &mut r).await.unwrap());
        let id = r.id.clone();
        // Every region read at 92 % of the bake: 100 rps each (300 < 1,000).
        let early = T0 + 3_300_000;
        for x in ["a", "b", "c"] {
            counted(&st, &id, x, 3300.0, 100.0, early).await;
        }
        let mut open = reread(&st).await;
        assert_eq!(
            judge(&st, &mut open, ms_time(early).unwrap())
                .await
                .unwrap(),
            vec![]
        );
        // The bake is over; c could not be read since.
        let now = T0 + 3_700_000;
        for x in ["a", "b"] {
            counted(&st, &id, x, 3700.0, 100.0, now).await;
        }
        let mut open = reread(&st).await;
        let out = judge(&st, &mut open, ms_time(now).unwrap()).await.unwrap();
        assert_eq!(out, vec![], "passed on c's stale counts");
        assert_eq!(reread(&st).await[0].state, RolloutState::Baking);
        // c read again: the stage passes.
        let later = now + 10_000;
        for x in ["a", "b", "c"] {
            counted(&st, &id, x, 3710.0, 100.0, later).await;
        }
        let mut open = reread(&st).await;
        let out = judge(&st, &mut open, ms_time(later).unwrap())
            .await
            .unwrap();
        assert_eq!(out, vec![Transition::Done(id)]);
    }
    /// Down to one configured region: a rollout judged on the fleet is restarted as one stage
    /// of that region, judged on its controller's counts (the fleet's), and can end.
    #[tokio::test]
    async fn down_to_one_region_a_fleet_rollout_is_restarted_on_that_region() {
        let dir = tempfile::tempdir().unwrap();
        let st = store(&dir).await;
        let mut r = baking(&[&["a", "b"]], true, T0);
        assert!(save(&st, &mut r).await.unwrap());
        let open = account_at(&st, &["a"], T0 + 60_000).await;
        assert_eq!(open.len(), 1, "{open:?}");
        let next = open[0].clone();
        assert_ne!(next.id, r.id);
        assert_eq!(next.stages, vec![regions(&["a"])]);
        assert_eq!(next.fleet, None);
        assert_eq!(next.state, RolloutState::Baking);
        assert_eq!(desired_for("a", &doc(), &open).candidates[0].id, next.id);
        // Its candidate reaches a; a's counts over the bake pass it.
        let mut open = reread(&st).await;
        reached(&st, &mut open, "a", ms_time(T0 + 60_000).unwrap())
            .await
            .unwrap();
        let now = T0 + 60_000 + 3_700_000;
        counted(&st, &next.id, "a", 3700.0, 600.0, now).await;
        let mut open = reread(&st).await;
        let out = judge(&st, &mut open, ms_time(now).unwrap()).await.unwrap();
        assert_eq!(out, vec![Transition::Done(next.id.clone())]);
        // Accounted again over one region: nothing restarts.
        assert!(account_at(&st, &["a"], now + 1_000).await.is_empty());
    }
}
