//! Which blocks each pipeline stage holds: the model's `n` blocks cut into `pp · v` consecutive
//! model chunks (virtual stages), evenly or by given counts, chunk `c · pp + r` on pipeline
//! rank `r` (Megatron's interleaved layout: rank `r` holds chunks `r, r + pp, …`). The first
//! stage also holds the embedding, the last the final norm, the output layer and the loss.

use std::ops::Range;

use crate::error::ConfigError;

/// The blocks of each virtual stage, in model order: `stages[s]` for stage `s` of `pp · v`.
/// `counts`, when given, says how many blocks each virtual stage takes (every one at least
/// one, adding up to `n`); otherwise each takes `n / (pp · v)`, which must divide.
pub fn virtual_stages(
    n: usize,
    pp: usize,
    v: usize,
    counts: Option<&[usize]>,
) -> Result<Vec<Range<usize>>, ConfigError> {
    let stages = pp * v;
    if stages == 0 {
        return Err(ConfigError::Zero {
            what: "pipeline ranks and model chunks",
        });
    }
    let counts: Vec<usize> = match counts {
        Some(counts) => {
            if counts.len() != stages || counts.contains(&0) || counts.iter().sum::<usize>() != n {
                return Err(ConfigError::StageLayers {
                    layers: n,
                    stages,
                    counts: counts.to_vec(),
                });
            }
            counts.to_vec()
        }
        None => match n.is_multiple_of(stages) && n >= stages {
            true => vec![n / stages; stages],
            false => {
                return Err(ConfigError::StageLayers {
                    layers: n,
                    stages,
                    counts: Vec::new(),
                });
            }
        },
    };
    Ok(counts
        .iter()
        .scan(0, |start, &c| {
            let range = *start..*start + c;
            *start += c;
            Some(range)
        })
        .collect())
}

/// The blocks pipeline rank `rank` holds, chunk by chunk: `virtual_stages(…)[c · pp + rank]`.
pub fn rank_chunks(stages: &[Range<usize>], pp: usize, rank: usize) -> Vec<Range<usize>> {
    stages.iter().skip(rank).step_by(pp).cloned().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_split_evenly_or_as_given() {
        // 8 blocks over pp 2 × v 2: chunks of 2, rank 0 holding chunks 0 and 2.
        let stages = virtual_stages(8, 2, 2, None).unwrap();
        assert_eq!(stages, vec![0..2, 2..4, 4..6, 6..8]);
        assert_eq!(rank_chunks(&stages, 2, 0), vec![0..2, 4..6]);
        assert_eq!(rank_chunks(&stages, 2, 1), vec![2..4, 6..8]);
        // Given counts: a lighter last stage for the output layer.
        let stages = virtual_stages(7, 2, 1, Some(&[4, 3])).unwrap();
        assert_eq!(stages, vec![0..4, 4..7]);
        assert_eq!(rank_chunks(&stages, 2, 1), vec![4..7]);
    }

    #[test]
    fn blocks_that_do_not_split_as_asked_are_typed_errors() {
        let error = |counts: Vec<usize>| ConfigError::StageLayers {
            layers: 7,
            stages: 2,
            counts,
        };
        assert_eq!(virtual_stages(7, 2, 1, None), Err(error(vec![])));
        assert_eq!(virtual_stages(7, 2, 1, Some(&[4, 4])), Err(error(vec![4, 4])));
        assert_eq!(virtual_stages(7, 2, 1, Some(&[7, 0])), Err(error(vec![7, 0])));
        assert_eq!(virtual_stages(7, 2, 1, Some(&[7])), Err(error(vec![7])));
        assert!(matches!(
            virtual_stages(2, 2, 2, None),
            Err(ConfigError::StageLayers { .. })
        ));
        let message = virtual_stages(7, 2, 1, None).unwrap_err().to_string();
        assert!(
            message.contains("7 blocks") && message.contains("2 pipeline stages"),
            "{message}"
        );
    }
}
