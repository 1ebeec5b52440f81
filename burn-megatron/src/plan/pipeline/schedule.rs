//! Pipeline schedules as plain lists of actions, one list a pipeline rank: forwards and
//! backwards of (microbatch, model chunk) and the sends and receives between them. A schedule is
//! generated here, checked by [`simulate`] (which runs every rank's list against the others and
//! reports a deadlock, a missing or repeated step, or a message nobody takes), and executed in
//! order by the pipeline runtime (still to come: `pp > 1` is refused by the plan until then).
//!
//! Layout (Megatron's): rank `r` of `pp` holds model chunks `r, r + pp, …` (`v` of them with
//! virtual stages), so virtual stage `s = chunk · pp + r` of `pp · v`; activations go from stage
//! `s` to `s + 1`, gradients back. Sends are buffered (a send returns at once; the receive
//! waits for it), as the communicator's point-to-point calls are.

use crate::error::ConfigError;

use super::PipelineSchedule;

/// What crosses between stages.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Payload {
    /// A stage's output, to the next stage's forward.
    Activation,
    /// The gradient of a stage's input, to the previous stage's backward.
    Gradient,
}

/// One thing a pipeline rank does, in its list's order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// The forward of `microbatch` through this rank's model chunk `chunk`.
    Forward { microbatch: usize, chunk: usize },
    /// Its backward.
    Backward { microbatch: usize, chunk: usize },
    /// Sends the `payload` of `microbatch` at virtual stage `stage` to pipeline rank `peer`.
    Send {
        peer: usize,
        payload: Payload,
        microbatch: usize,
        stage: usize,
    },
    /// Waits for it.
    Recv {
        peer: usize,
        payload: Payload,
        microbatch: usize,
        stage: usize,
    },
}

/// A whole pipeline's actions: `ranks[r]` is pipeline rank `r`'s list.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Schedule {
    pub pp: usize,
    /// Model chunks a rank (1 without virtual stages).
    pub chunks: usize,
    pub microbatches: usize,
    pub ranks: Vec<Vec<Action>>,
}

impl PipelineSchedule {
    /// Model chunks a rank.
    pub fn chunks(self) -> usize {
        match self {
            Self::Interleaved { virtual_stages } => virtual_stages,
            _ => 1,
        }
    }

    /// Checks that `microbatches` suit this schedule over `pp` ranks: at least one; with
    /// virtual stages, at least two chunks a rank and a whole number of rounds of `pp`
    /// microbatches (Megatron's interleaved schedule walks them `pp` at a time).
    pub fn check_microbatches(self, pp: usize, microbatches: usize) -> Result<(), ConfigError> {
        if pp == 0 || microbatches == 0 {
            return Err(ConfigError::Zero {
                what: "pipeline ranks and microbatches",
            });
        }
        match self {
            Self::Interleaved { virtual_stages } if virtual_stages < 2 => {
                Err(ConfigError::VirtualStages { virtual_stages })
            }
            Self::Interleaved { .. } if microbatches < pp || !microbatches.is_multiple_of(pp) => {
                Err(ConfigError::Microbatches { microbatches, pp })
            }
            _ => Ok(()),
        }
    }

    /// Every rank's actions for `microbatches` microbatches over `pp` ranks.
    pub fn actions(self, pp: usize, microbatches: usize) -> Result<Schedule, ConfigError> {
        self.check_microbatches(pp, microbatches)?;
        let v = self.chunks();
        let ranks = (0..pp)
            .map(|rank| {
                let order = self.compute_order(pp, microbatches, rank);
                with_messages(&order, pp, v, rank)
            })
            .collect();
        Ok(Schedule {
            pp,
            chunks: v,
            microbatches,
            ranks,
        })
    }

    /// Rank `rank`'s forwards and backwards in order, without the messages.
    fn compute_order(self, pp: usize, m: usize, rank: usize) -> Vec<Action> {
        let forward = |microbatch, chunk| Action::Forward { microbatch, chunk };
        let backward = |microbatch, chunk| Action::Backward { microbatch, chunk };
        match self {
            Self::GPipe => (0..m)
                .map(|i| forward(i, 0))
                .chain((0..m).map(|i| backward(i, 0)))
                .collect(),
            Self::OneForwardOneBackward => {
                // Warm-up forwards fill the pipeline below this rank; then one forward, one
                // backward; the cool-down drains the backwards.
                let warmup = (pp - rank - 1).min(m);
                let mut order: Vec<Action> = (0..warmup).map(|i| forward(i, 0)).collect();
                for i in warmup..m {
                    order.push(forward(i, 0));
                    order.push(backward(i - warmup, 0));
                }
                order.extend((m - warmup..m).map(|i| backward(i, 0)));
                order
            }
            Self::Interleaved { virtual_stages: v } => {
                // Virtual microbatch k (of m·v): chunk (k / pp) mod v, microbatch
                // (k / (pp·v))·pp + k mod pp; backwards walk the chunks from the last.
                let total = m * v;
                let unit = |k: usize, reverse: bool| {
                    let chunk = (k / pp) % v;
                    let chunk = if reverse { v - 1 - chunk } else { chunk };
                    ((k / (pp * v)) * pp + k % pp, chunk)
                };
                let warmup = ((pp - rank - 1) * 2 + (v - 1) * pp).min(total);
                let mut order = Vec::with_capacity(2 * total);
                for k in 0..warmup {
                    let (i, c) = unit(k, false);
                    order.push(forward(i, c));
                }
                for k in warmup..total {
                    let (i, c) = unit(k, false);
                    order.push(forward(i, c));
                    let (i, c) = unit(k - warmup, true);
                    order.push(backward(i, c));
                }
                for k in total - warmup..total {
                    let (i, c) = unit(k, true);
                    order.push(backward(i, c));
                }
                order
            }
        }
    }
}

/// `order` with the receive each step needs before it and the send it makes after it.
fn with_messages(order: &[Action], pp: usize, v: usize, rank: usize) -> Vec<Action> {
    let stages = pp * v;
    let stage = |chunk: usize| chunk * pp + rank;
    let mut out = Vec::with_capacity(3 * order.len());
    for &action in order {
        match action {
            Action::Forward { microbatch, chunk } => {
                let s = stage(chunk);
                if s > 0 && pp > 1 {
                    out.push(Action::Recv {
                        peer: (s - 1) % pp,
                        payload: Payload::Activation,
                        microbatch,
                        stage: s - 1,
                    });
                }
                out.push(action);
                if s + 1 < stages && pp > 1 {
                    out.push(Action::Send {
                        peer: (s + 1) % pp,
                        payload: Payload::Activation,
                        microbatch,
                        stage: s,
                    });
                }
            }
            Action::Backward { microbatch, chunk } => {
                let s = stage(chunk);
                if s + 1 < stages && pp > 1 {
                    out.push(Action::Recv {
                        peer: (s + 1) % pp,
                        payload: Payload::Gradient,
                        microbatch,
                        stage: s + 1,
                    });
                }
                out.push(action);
                if s > 0 && pp > 1 {
                    out.push(Action::Send {
                        peer: (s - 1) % pp,
                        payload: Payload::Gradient,
                        microbatch,
                        stage: s,
                    });
                }
            }
            other => out.push(other),
        }
    }
    out
}

/// What running a schedule showed.
#[derive(Clone, Debug, PartialEq)]
pub struct Simulation {
    /// The time every rank was done, a forward of one chunk taking `1/v` and its backward
    /// `2/v` (messages free).
    pub makespan: f64,
    /// The share of the ranks' time spent waiting: `1 − work / (pp · makespan)`.
    pub bubble: f64,
    /// The most microbatches' activations a rank held at once (forwards not yet backed).
    pub peak_in_flight: Vec<usize>,
}

/// Why a schedule cannot run.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ScheduleError {
    #[error("deadlock: every rank waits; rank {rank} at its action {position} ({action:?})")]
    Deadlock {
        rank: usize,
        position: usize,
        action: Action,
    },
    #[error("rank {rank} runs {action:?} before what it needs")]
    OutOfOrder { rank: usize, action: Action },
    #[error("microbatch {microbatch} at stage {stage}: its {what} runs {times} times")]
    Count {
        microbatch: usize,
        stage: usize,
        what: &'static str,
        times: usize,
    },
    #[error("{left} messages were sent and never received")]
    Unreceived { left: usize },
}

/// Runs every rank's list against the others: a receive waits for its send; a forward needs
/// the previous stage's forward of its microbatch, a backward its own forward and the next
/// stage's backward. Returns the timing under [`Simulation`]'s cost model, or why it cannot
/// run.
pub fn simulate(schedule: &Schedule) -> Result<Simulation, ScheduleError> {
    use std::collections::HashMap;
    let (pp, v, m) = (schedule.pp, schedule.chunks, schedule.microbatches);
    let stages = pp * v;
    let (f, b) = (1.0 / v as f64, 2.0 / v as f64);
    // When each forward and backward of (microbatch, stage) finished.
    let mut forwards: HashMap<(usize, usize), f64> = HashMap::new();
    let mut backwards: HashMap<(usize, usize), f64> = HashMap::new();
    // (receiver, payload, microbatch, stage) → (sender, time sent).
    let mut mail: HashMap<(usize, Payload, usize, usize), (usize, f64)> = HashMap::new();
    let mut at = vec![0usize; pp];
    let mut clock = vec![0.0f64; pp];
    let mut held = vec![0usize; pp];
    let mut peak = vec![0usize; pp];
    let mut work = 0.0;
    let count = |what: &'static str, microbatch, stage, times| ScheduleError::Count {
        microbatch,
        stage,
        what,
        times,
    };
    loop {
        let mut moved = false;
        for rank in 0..pp {
            while let Some(&action) = schedule.ranks[rank].get(at[rank]) {
                let stage = |chunk: usize| chunk * pp + rank;
                match action {
                    Action::Recv {
                        peer,
                        payload,
                        microbatch,
                        stage: s,
                    } => match mail.remove(&(rank, payload, microbatch, s)) {
                        Some((from, sent)) if from == peer => clock[rank] = clock[rank].max(sent),
                        Some(_) => return Err(ScheduleError::OutOfOrder { rank, action }),
                        None => break,
                    },
                    Action::Send {
                        peer,
                        payload,
                        microbatch,
                        stage: s,
                    } => {
                        mail.insert((peer, payload, microbatch, s), (rank, clock[rank]));
                    }
                    Action::Forward { microbatch, chunk } => {
                        let s = stage(chunk);
                        let ready = match s {
                            0 => Some(0.0),
                            _ => forwards.get(&(microbatch, s - 1)).copied(),
                        };
                        let Some(ready) = ready else {
                            return Err(ScheduleError::OutOfOrder { rank, action });
                        };
                        clock[rank] = clock[rank].max(ready) + f;
                        work += f;
                        if forwards.insert((microbatch, s), clock[rank]).is_some() {
                            return Err(count("forward", microbatch, s, 2));
                        }
                        held[rank] += 1;
                        peak[rank] = peak[rank].max(held[rank]);
                    }
                    Action::Backward { microbatch, chunk } => {
                        let s = stage(chunk);
                        let own = forwards.get(&(microbatch, s)).copied();
                        let next = match s + 1 == stages {
                            true => own,
                            false => backwards.get(&(microbatch, s + 1)).copied(),
                        };
                        let (Some(own), Some(next)) = (own, next) else {
                            return Err(ScheduleError::OutOfOrder { rank, action });
                        };
                        clock[rank] = clock[rank].max(own).max(next) + b;
                        work += b;
                        if backwards.insert((microbatch, s), clock[rank]).is_some() {
                            return Err(count("backward", microbatch, s, 2));
                        }
                        held[rank] -= 1;
                    }
                }
                at[rank] += 1;
                moved = true;
            }
        }
        if at.iter().zip(&schedule.ranks).all(|(&a, list)| a == list.len()) {
            break;
        }
        if !moved {
            let rank = (0..pp).find(|&r| at[r] < schedule.ranks[r].len()).unwrap_or(0);
            return Err(ScheduleError::Deadlock {
                rank,
                position: at[rank],
                action: schedule.ranks[rank][at[rank]],
            });
        }
    }
    for microbatch in 0..m {
        for stage in 0..stages {
            for (what, done) in [("forward", &forwards), ("backward", &backwards)] {
                if !done.contains_key(&(microbatch, stage)) {
                    return Err(count(what, microbatch, stage, 0));
                }
            }
        }
    }
    if !mail.is_empty() {
        return Err(ScheduleError::Unreceived { left: mail.len() });
    }
    let makespan = clock.iter().cloned().fold(0.0, f64::max);
    Ok(Simulation {
        makespan,
        bubble: 1.0 - work / (pp as f64 * makespan),
        peak_in_flight: peak,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: [PipelineSchedule; 5] = [
        PipelineSchedule::GPipe,
        PipelineSchedule::OneForwardOneBackward,
        PipelineSchedule::Interleaved { virtual_stages: 2 },
        PipelineSchedule::Interleaved { virtual_stages: 3 },
        PipelineSchedule::Interleaved { virtual_stages: 4 },
    ];

    /// Every schedule on every (pp, vpp, microbatches) up to 8 × 4 × 16 runs without a
    /// deadlock, each forward and backward once, every message taken.
    #[test]
    fn every_schedule_runs_to_the_end() {
        for schedule in ALL {
            for pp in 1..=8 {
                for m in 1..=16 {
                    if schedule.check_microbatches(pp, m).is_err() {
                        continue;
                    }
                    let actions = schedule.actions(pp, m).unwrap();
                    simulate(&actions).unwrap_or_else(|e| panic!("{schedule:?} pp {pp} m {m}: {e}"));
                }
            }
        }
    }

    /// The bubble the cost model gives is the closed form: `(p − 1) / (m + p − 1)` for GPipe
    /// and 1F1B, `(p − 1)/v / (m + (p − 1)/v)` interleaved; 1F1B holds at most `p − r`
    /// microbatches on rank `r`, GPipe all `m`.
    #[test]
    fn bubbles_and_memory_are_the_closed_forms() {
        for pp in [2, 4, 8] {
            for m in [8, 16] {
                let p = pp as f64;
                for schedule in ALL {
                    let v = schedule.chunks() as f64;
                    let sim = simulate(&schedule.actions(pp, m).unwrap()).unwrap();
                    let expected = ((p - 1.0) / v) / (m as f64 + (p - 1.0) / v);
                    assert!(
                        (sim.bubble - expected).abs() < 1e-9,
                        "{schedule:?} pp {pp} m {m}: bubble {} vs {expected}",
                        sim.bubble
                    );
                }
                let one = simulate(&PipelineSchedule::OneForwardOneBackward.actions(pp, m).unwrap()).unwrap();
                assert_eq!(one.peak_in_flight, (0..pp).map(|r| pp - r).collect::<Vec<_>>());
                let all = simulate(&PipelineSchedule::GPipe.actions(pp, m).unwrap()).unwrap();
                assert_eq!(all.peak_in_flight, vec![m; pp]);
            }
        }
    }

    /// A schedule that is wrong is caught: a backward before its forward, a backward whose
    /// gradient never arrived, a message nobody takes, two ranks waiting on each other.
    #[test]
    fn broken_schedules_are_caught() {
        let good = PipelineSchedule::OneForwardOneBackward.actions(2, 4).unwrap();
        let mut swapped = good.clone();
        let first_backward = swapped.ranks[1]
            .iter()
            .position(|a| matches!(a, Action::Backward { .. }))
            .unwrap();
        swapped.ranks[1].swap(0, first_backward);
        assert!(simulate(&swapped).is_err());
        let mut unread = good.clone();
        unread.ranks[0].retain(|a| !matches!(a, Action::Recv { .. }));
        assert!(
            matches!(simulate(&unread), Err(ScheduleError::OutOfOrder { rank: 0, .. })),
            "a backward without its gradient's receive runs before the gradient exists"
        );
        let mut extra = good.clone();
        extra.ranks[1].push(Action::Send {
            peer: 0,
            payload: Payload::Gradient,
            microbatch: 0,
            stage: 1,
        });
        assert!(matches!(simulate(&extra), Err(ScheduleError::Unreceived { left: 1 })));
        let mut stuck = good;
        stuck.ranks[0].insert(
            0,
            Action::Recv {
                peer: 1,
                payload: Payload::Gradient,
                microbatch: 3,
                stage: 1,
            },
        );
        assert!(matches!(simulate(&stuck), Err(ScheduleError::Deadlock { .. })));
    }

    #[test]
    fn bad_microbatch_counts_are_typed_errors() {
        let interleaved = PipelineSchedule::Interleaved { virtual_stages: 2 };
        assert_eq!(
            interleaved.check_microbatches(4, 2),
            Err(ConfigError::Microbatches { microbatches: 2, pp: 4 })
        );
        assert_eq!(
            interleaved.check_microbatches(4, 6),
            Err(ConfigError::Microbatches { microbatches: 6, pp: 4 })
        );
        assert_eq!(
            PipelineSchedule::Interleaved { virtual_stages: 1 }.check_microbatches(2, 4),
            Err(ConfigError::VirtualStages { virtual_stages: 1 })
        );
        assert!(PipelineSchedule::OneForwardOneBackward.check_microbatches(4, 2).is_ok());
        assert!(matches!(
            PipelineSchedule::GPipe.check_microbatches(2, 0),
            Err(ConfigError::Zero { .. })
        ));
    }
}
