//! A small TCP key-value store: the rendezvous of one-process-a-rank runs.
//!
//! Global rank 0 serves it at `MASTER_ADDR:MASTER_PORT`; every rank keeps one connection. It
//! carries the NCCL unique ids, the agreement records of every collective and the headers of
//! point-to-point messages, so those checks never touch the GPU. A value set for `readers`
//! readers is dropped after the last one has read it. A gather (every rank's value for one key,
//! as the agreement check needs) is one round trip: the server answers once all have come.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

const SET: u8 = 1;
const GET: u8 = 2;
const GATHER: u8 = 3;
const FOUND: u8 = 0;
const ABSENT: u8 = 1;

#[derive(Default)]
struct Table {
    entries: Mutex<Entries>,
    changed: Condvar,
}

#[derive(Default)]
struct Entries {
    /// key → (value, reads left; 0 keeps it forever)
    values: HashMap<String, (Vec<u8>, u32)>,
    gathers: HashMap<String, Gathering>,
}

/// One gather: each member's value once it came, and how many members have taken the whole.
struct Gathering {
    values: Vec<Option<Vec<u8>>>,
    taken: usize,
}

/// The server half, run by global rank 0 on a background thread.
pub struct StoreServer {
    address: String,
}

impl StoreServer {
    /// Listens on `address` (such as `0.0.0.0:29500`) and serves every connection on a thread.
    pub fn start(address: &str) -> io::Result<Self> {
        let listener = TcpListener::bind(address)?;
        let address = listener.local_addr()?.to_string();
        let table = Arc::new(Table::default());
        std::thread::Builder::new()
            .name("burn-megatron-store".into())
            .spawn(move || {
                for stream in listener.incoming().flatten() {
                    let table = table.clone();
                    let _ = std::thread::Builder::new()
                        .name("burn-megatron-store-conn".into())
                        .spawn(move || serve(stream, &table));
                }
            })?;
        Ok(Self { address })
    }

    /// The address it listens on (with the port the system chose, if 0 was asked).
    pub fn address(&self) -> &str {
        &self.address
    }
}

fn serve(mut stream: TcpStream, table: &Table) {
    let _ = stream.set_nodelay(true);
    while let Ok(op) = read_u8(&mut stream) {
        let reply = (|| -> io::Result<()> {
            let key = String::from_utf8_lossy(&read_bytes(&mut stream)?).into_owned();
            match op {
                SET => {
                    let readers = read_u32(&mut stream)?;
                    let value = read_bytes(&mut stream)?;
                    table
                        .entries
                        .lock()
                        .expect("store")
                        .values
                        .insert(key, (value, readers));
                    table.changed.notify_all();
                    stream.write_all(&[FOUND])
                }
                GATHER => {
                    let (index, members) = (read_u32(&mut stream)? as usize, read_u32(&mut stream)? as usize);
                    let timeout = Duration::from_millis(read_u64(&mut stream)?);
                    let value = read_bytes(&mut stream)?;
                    match gather(table, key, index, members, value, timeout)? {
                        Ok(values) => {
                            stream.write_all(&[FOUND])?;
                            values.iter().try_for_each(|v| write_bytes(&mut stream, v))
                        }
                        Err(missing) => {
                            stream.write_all(&[ABSENT])?;
                            let missing: Vec<u8> = missing.iter().flat_map(|&m| (m as u32).to_le_bytes()).collect();
                            write_bytes(&mut stream, &missing)
                        }
                    }
                }
                GET => {
                    let timeout = Duration::from_millis(read_u64(&mut stream)?);
                    let value = wait_for(table, &key, timeout);
                    match value {
                        Some(value) => {
                            stream.write_all(&[FOUND])?;
                            write_bytes(&mut stream, &value)
                        }
                        None => stream.write_all(&[ABSENT]),
                    }
                }
                _ => Err(io::Error::new(io::ErrorKind::InvalidData, "unknown store operation")),
            }
        })();
        if reply.is_err() {
            return;
        }
    }
}

fn wait_for(table: &Table, key: &str, timeout: Duration) -> Option<Vec<u8>> {
    let deadline = Instant::now() + timeout;
    let mut entries = table.entries.lock().expect("store");
    loop {
        if let Some((value, readers)) = entries.values.get_mut(key) {
            let value = value.clone();
            if *readers > 0 {
                *readers -= 1;
                if *readers == 0 {
                    entries.values.remove(key);
                }
            }
            return Some(value);
        }
        let now = Instant::now();
        if now >= deadline {
            return None;
        }
        entries = table.changed.wait_timeout(entries, deadline - now).expect("store").0;
    }
}

/// Leaves member `index`'s value under `key` and waits for all `members`' values: returns them
/// in member order, or the members still missing at the deadline. The entry goes once every
/// member has taken it.
fn gather(
    table: &Table,
    key: String,
    index: usize,
    members: usize,
    value: Vec<u8>,
    timeout: Duration,
) -> io::Result<Result<Vec<Vec<u8>>, Vec<usize>>> {
    let deadline = Instant::now() + timeout;
    let mut entries = table.entries.lock().expect("store");
    let gathering = entries.gathers.entry(key.clone()).or_insert_with(|| Gathering {
        values: vec![None; members],
        taken: 0,
    });
    if index >= members || gathering.values.len() != members {
        let detail = format!(
            "gather {key}: member {index} of {members}, but it has {}",
            gathering.values.len()
        );
        return Err(io::Error::new(io::ErrorKind::InvalidData, detail));
    }
    gathering.values[index] = Some(value);
    table.changed.notify_all();
    loop {
        let Gathering { values, taken } = entries.gathers.get_mut(&key).expect("open gather");
        if values.iter().all(Option::is_some) {
            let all = values.iter().map(|v| v.clone().expect("present")).collect();
            *taken += 1;
            if *taken == members {
                entries.gathers.remove(&key);
            }
            return Ok(Ok(all));
        }
        let now = Instant::now();
        if now >= deadline {
            return Ok(Err((0..members).filter(|&m| values[m].is_none()).collect()));
        }
        entries = table.changed.wait_timeout(entries, deadline - now).expect("store").0;
    }
}

/// One rank's connection to the store.
pub struct StoreClient {
    stream: Mutex<TcpStream>,
}

impl StoreClient {
    /// Connects to `address`, retrying until `timeout` while the server starts.
    pub fn connect(address: &str, timeout: Duration) -> io::Result<Self> {
        let deadline = Instant::now() + timeout;
        loop {
            let attempt = address.to_socket_addrs().and_then(|mut addrs| {
                let addr = addrs.next().ok_or_else(|| io::Error::other("no address"))?;
                TcpStream::connect_timeout(&addr, Duration::from_secs(1))
            });
            match attempt {
                Ok(stream) => {
                    stream.set_nodelay(true)?;
                    return Ok(Self {
                        stream: Mutex::new(stream),
                    });
                }
                Err(error) if Instant::now() >= deadline => return Err(error),
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        }
    }

    /// Stores `value` under `key`, to be read `readers` times (0: kept).
    pub fn set(&self, key: &str, value: &[u8], readers: u32) -> io::Result<()> {
        let mut stream = self.stream.lock().expect("store connection");
        stream.write_all(&[SET])?;
        write_bytes(&mut *stream, key.as_bytes())?;
        stream.write_all(&readers.to_le_bytes())?;
        write_bytes(&mut *stream, value)?;
        match read_u8(&mut *stream)? {
            FOUND => Ok(()),
            _ => Err(io::Error::new(io::ErrorKind::InvalidData, "store refused a set")),
        }
    }

    /// The value under `key`, waiting up to `timeout` for it; `None` if it never came.
    pub fn get(&self, key: &str, timeout: Duration) -> io::Result<Option<Vec<u8>>> {
        let mut stream = self.stream.lock().expect("store connection");
        stream.write_all(&[GET])?;
        write_bytes(&mut *stream, key.as_bytes())?;
        // Rounded up, so the server never waits less than asked.
        stream.write_all(&(timeout.as_micros().div_ceil(1000) as u64).to_le_bytes())?;
        match read_u8(&mut *stream)? {
            FOUND => Ok(Some(read_bytes(&mut *stream)?)),
            _ => Ok(None),
        }
    }
}

impl StoreClient {
    /// Leaves this member's `value` under `key` and returns every member's, in member order,
    /// in one round trip; `Err` holds the members whose value had not come within `timeout`.
    pub fn gather(
        &self,
        key: &str,
        index: usize,
        members: usize,
        value: &[u8],
        timeout: Duration,
    ) -> io::Result<Result<Vec<Vec<u8>>, Vec<usize>>> {
        let mut stream = self.stream.lock().expect("store connection");
        stream.write_all(&[GATHER])?;
        write_bytes(&mut *stream, key.as_bytes())?;
        stream.write_all(&(index as u32).to_le_bytes())?;
        stream.write_all(&(members as u32).to_le_bytes())?;
        stream.write_all(&(timeout.as_micros().div_ceil(1000) as u64).to_le_bytes())?;
        write_bytes(&mut *stream, value)?;
        match read_u8(&mut *stream)? {
            FOUND => Ok(Ok((0..members)
                .map(|_| read_bytes(&mut *stream))
                .collect::<io::Result<_>>()?)),
            _ => {
                let missing = read_bytes(&mut *stream)?;
                Ok(Err(missing
                    .chunks_exact(4)
                    .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")) as usize)
                    .collect()))
            }
        }
    }
}

fn read_u8(r: &mut impl Read) -> io::Result<u8> {
    let mut b = [0; 1];
    r.read_exact(&mut b)?;
    Ok(b[0])
}

fn read_u32(r: &mut impl Read) -> io::Result<u32> {
    let mut b = [0; 4];
    r.read_exact(&mut b)?;
    Ok(u32::from_le_bytes(b))
}

fn read_u64(r: &mut impl Read) -> io::Result<u64> {
    let mut b = [0; 8];
    r.read_exact(&mut b)?;
    Ok(u64::from_le_bytes(b))
}

fn read_bytes(r: &mut impl Read) -> io::Result<Vec<u8>> {
    let len = read_u32(r)? as usize;
    let mut v = vec![0; len];
    r.read_exact(&mut v)?;
    Ok(v)
}

fn write_bytes(w: &mut impl Write, bytes: &[u8]) -> io::Result<()> {
    w.write_all(&(bytes.len() as u32).to_le_bytes())?;
    w.write_all(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_meet_their_readers_and_then_go() {
        let server = StoreServer::start("127.0.0.1:0").unwrap();
        let a = StoreClient::connect(server.address(), Duration::from_secs(5)).unwrap();
        let b = StoreClient::connect(server.address(), Duration::from_secs(5)).unwrap();
        let reader = std::thread::spawn(move || b.get("k", Duration::from_secs(5)).unwrap());
        std::thread::sleep(Duration::from_millis(50));
        a.set("k", b"hello", 1).unwrap();
        assert_eq!(reader.join().unwrap(), Some(b"hello".to_vec()));
        // Read once, by its one reader: gone.
        assert_eq!(a.get("k", Duration::ZERO).unwrap(), None);
        a.set("kept", b"x", 0).unwrap();
        assert_eq!(a.get("kept", Duration::ZERO).unwrap(), Some(b"x".to_vec()));
        assert_eq!(a.get("kept", Duration::ZERO).unwrap(), Some(b"x".to_vec()));
    }

    #[test]
    fn a_gather_answers_every_member_once_all_came() {
        let server = StoreServer::start("127.0.0.1:0").unwrap();
        let connect = || StoreClient::connect(server.address(), Duration::from_secs(5)).unwrap();
        let members = 3;
        let ranks: Vec<_> = (0..members)
            .map(|m| {
                let client = connect();
                std::thread::spawn(move || {
                    // The last member comes late: the others wait for it.
                    if m == members - 1 {
                        std::thread::sleep(Duration::from_millis(50));
                    }
                    client
                        .gather("g", m, members, &[m as u8; 2], Duration::from_secs(5))
                        .unwrap()
                })
            })
            .collect();
        for rank in ranks {
            assert_eq!(rank.join().unwrap(), Ok(vec![vec![0, 0], vec![1, 1], vec![2, 2]]));
        }
        // Taken by all three: the key is free for the next gather.
        let a = connect();
        let missing = a.gather("g", 0, 2, b"again", Duration::from_millis(100)).unwrap();
        assert_eq!(missing, Err(vec![1]), "a member that never came is named");
    }

    #[test]
    fn a_missing_key_times_out() {
        let server = StoreServer::start("127.0.0.1:0").unwrap();
        let a = StoreClient::connect(server.address(), Duration::from_secs(5)).unwrap();
        let start = Instant::now();
        assert_eq!(a.get("never", Duration::from_millis(200)).unwrap(), None);
        assert!(start.elapsed() >= Duration::from_millis(200));
    }
}
