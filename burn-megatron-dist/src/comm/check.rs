//! The agreement check every collective makes before any data moves.
//!
//! Each rank describes its call in a [`Record`]; the transport exchanges the records over its
//! host-side channel, and every rank runs the same [`verify`] on the same list, so a mismatch is
//! the same error on every rank instead of a hang or garbage.

use crate::error::CommError;

/// The collectives, as the checks name them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Collective {
    AllReduce,
    AllGather,
    ReduceScatter,
    AllToAll,
    Broadcast,
    Barrier,
    Send,
    Recv,
}

impl Collective {
    pub fn name(self) -> &'static str {
        match self {
            Collective::AllReduce => "all_reduce",
            Collective::AllGather => "all_gather",
            Collective::ReduceScatter => "reduce_scatter",
            Collective::AllToAll => "all_to_all",
            Collective::Broadcast => "broadcast",
            Collective::Barrier => "barrier",
            Collective::Send => "send",
            Collective::Recv => "recv",
        }
    }

    fn code(self) -> u64 {
        self as u64
    }

    fn from_code(code: u64) -> Option<Self> {
        use Collective::*;
        [
            AllReduce,
            AllGather,
            ReduceScatter,
            AllToAll,
            Broadcast,
            Barrier,
            Send,
            Recv,
        ]
        .get(code as usize)
        .copied()
    }
}

/// One rank's description of its call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    pub collective: Collective,
    /// The dtype, as Burn prints it.
    pub dtype: String,
    /// The caller's full shape.
    pub shape: Vec<usize>,
    /// The dim the collective works on, the root, the reduction: whatever must agree.
    pub args: Vec<usize>,
    /// Sizes sent to each rank (all-to-all only).
    pub splits: Vec<usize>,
}

impl Record {
    pub fn encode(&self) -> Vec<u8> {
        let mut words = vec![self.collective.code(), self.dtype.len() as u64];
        for list in [&self.shape, &self.args, &self.splits] {
            words.push(list.len() as u64);
            words.extend(list.iter().map(|&v| v as u64));
        }
        let mut bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        bytes.extend_from_slice(self.dtype.as_bytes());
        bytes
    }

    pub fn decode(bytes: &[u8]) -> Option<Self> {
        let mut words = bytes.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().unwrap()));
        let collective = Collective::from_code(words.next()?)?;
        let dtype_len = words.next()? as usize;
        let list = |words: &mut dyn Iterator<Item = u64>| -> Option<Vec<usize>> {
            let len = words.next()? as usize;
            (0..len).map(|_| words.next().map(|v| v as usize)).collect()
        };
        let shape = list(&mut words)?;
        let args = list(&mut words)?;
        let splits = list(&mut words)?;
        let used = 8 * (5 + shape.len() + args.len() + splits.len());
        let dtype = String::from_utf8(bytes.get(used..used + dtype_len)?.to_vec()).ok()?;
        Some(Self {
            collective,
            dtype,
            shape,
            args,
            splits,
        })
    }
}

/// Checks that the records of every group rank describe one consistent call.
///
/// `dim` is the index into `shape` that may differ between ranks (all-to-all's concatenated
/// dim), if any.
pub fn verify(records: &[Record], varying_dim: Option<usize>) -> Result<(), String> {
    let first = &records[0];
    for (rank, record) in records.iter().enumerate().skip(1) {
        if record.collective != first.collective {
            return Err(format!(
                "group rank 0 called {} but group rank {rank} called {}",
                first.collective.name(),
                record.collective.name()
            ));
        }
        if record.dtype != first.dtype {
            return Err(format!(
                "dtype {} on group rank 0 but {} on group rank {rank}",
                first.dtype, record.dtype
            ));
        }
        if record.args != first.args {
            return Err(format!(
                "arguments {:?} on group rank 0 but {:?} on group rank {rank}",
                first.args, record.args
            ));
        }
        let same_shape = record.shape.len() == first.shape.len()
            && record
                .shape
                .iter()
                .zip(&first.shape)
                .enumerate()
                .all(|(d, (a, b))| a == b || Some(d) == varying_dim);
        if !same_shape {
            return Err(format!(
                "shape {:?} on group rank 0 but {:?} on group rank {rank}",
                first.shape, record.shape
            ));
        }
    }
    Ok(())
}

/// Builds the error every rank returns for a failed check.
pub fn mismatch(group: &str, collective: Collective, seq: u64, detail: String) -> CommError {
    CommError::Mismatch {
        group: group.to_string(),
        collective: collective.name(),
        seq,
        detail,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(shape: Vec<usize>) -> Record {
        Record {
            collective: Collective::AllGather,
            dtype: "F32".into(),
            shape,
            args: vec![1],
            splits: vec![3, 4],
        }
    }

    #[test]
    fn records_round_trip() {
        let r = record(vec![2, 3, 5]);
        assert_eq!(Record::decode(&r.encode()), Some(r));
        assert_eq!(Record::decode(&[1, 2, 3]), None);
    }

    #[test]
    fn verify_names_the_disagreement() {
        let ok = [record(vec![2, 3]), record(vec![2, 3])];
        assert_eq!(verify(&ok, None), Ok(()));
        let bad = [record(vec![2, 3]), record(vec![2, 4])];
        let err = verify(&bad, None).unwrap_err();
        assert!(err.contains("[2, 3]") && err.contains("[2, 4]"), "{err}");
        assert_eq!(verify(&bad, Some(1)), Ok(()));
        let mut other = record(vec![2, 3]);
        other.collective = Collective::AllReduce;
        assert!(
            verify(&[record(vec![2, 3]), other], None)
                .unwrap_err()
                .contains("all_reduce")
        );
    }
}
