//! Runs a pipeline [`Schedule`] on paper: every rank's action list against the others, a
//! receive waiting for its send, each step for what it needs. What a schedule generator must
//! pass before a runtime executes its lists, and the bubble and memory each schedule predicts.

use std::collections::HashMap;

use super::schedule::{Action, Payload, Schedule};

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
    use crate::plan::PipelineSchedule;

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
}
