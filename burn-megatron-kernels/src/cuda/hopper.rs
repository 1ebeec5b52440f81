//! The Hopper pieces our kernels share, as inline PTX (CubeCL 0.11 emits none of them itself):
//! mbarriers, TMA bulk tensor loads, `wgmma` shared-memory descriptors and the `wgmma` chains.
//!
//! Every operand tile sits in shared memory with the 128-byte swizzle, in boxes 64 bf16 wide
//! (one 128-byte row each), loaded by TMA (`wgmma_ptx::Tile` says how a `wgmma` reads one). The
//! accumulator of an `m64nN` chain is `N / 2` f32 registers a thread: warp `w` of the warpgroup
//! holds rows `16w..16w+15`; lane `l` holds, for each 8-column block `j`, the pair (row `l/4`,
//! columns `8j + 2(l%4) + {0, 1}`) in registers `4j, 4j+1`, and the same columns 8 rows lower in
//! `4j+2, 4j+3`. Read as bf16 pairs in that order, the registers of two neighbouring blocks are
//! exactly the A fragment of a 16-deep k-step, so a result feeds the next product from registers.

use cubecl::prelude::*;

pub(crate) use crate::cuda::ptx::wgmma::{ASource, Chain, Operands, Tile, settle_ptx};

/// The f32 accumulator of an `m64n64` chain.
pub(crate) type Acc64 = Vector<f32, Const<32>>;
/// The f32 accumulator of an `m64n128` chain.
pub(crate) type Acc128 = Vector<f32, Const<64>>;
/// The f32 accumulator of an `m64n256` chain.
pub(crate) type Acc256 = Vector<f32, Const<128>>;
/// A 64 × 64 bf16 A operand in registers: 4 k-steps of 4 bf16 pairs.
pub(crate) type Frags64 = Vector<u32, Const<16>>;
/// A 64 × 128 bf16 A operand in registers: 8 k-steps of 4 bf16 pairs.
pub(crate) type Frags128 = Vector<u32, Const<32>>;

/// `acc + A·B` for an `m64n256` chain with both operands in shared memory (the GEMM).
#[cube]
pub(crate) fn chain_256(acc: &Acc256, desc_a: u64, desc_b: u64, #[comptime] chain: Chain) -> Acc256 {
    let body = comptime![chain.ptx()];
    let old = load::<Acc256>(acc);
    let out: Acc256;
    gpu_asm!("{body}", "// {d} {c} {a} {b}", d = out(_) out, c = in(_) old, a = in(_) desc_a, b = in(_) desc_b);
    out
}

/// `A·B` for a fresh `m64n64` chain with both operands in shared memory (attention scores).
#[cube]
pub(crate) fn chain_64(desc_a: u64, desc_b: u64, #[comptime] chain: Chain) -> Acc64 {
    let body = comptime![chain.ptx()];
    let out: Acc64;
    gpu_asm!("{body}", "// {d} {a} {b}", d = out(_) out, a = in(_) desc_a, b = in(_) desc_b);
    out
}

/// `A·B` for a fresh `m64n128` chain with both operands in shared memory (the blockwise FP8
/// GEMM's partial products, one a 128-deep slice).
#[cube]
pub(crate) fn chain_128_fresh(desc_a: u64, desc_b: u64, #[comptime] chain: Chain) -> Acc128 {
    let body = comptime![chain.ptx()];
    let out: Acc128;
    gpu_asm!("{body}", "// {d} {a} {b}", d = out(_) out, a = in(_) desc_a, b = in(_) desc_b);
    out
}

/// `acc + A·B` for an `m64n128` chain, A from registers (attention's outputs and gradients).
#[cube]
pub(crate) fn chain_128(acc: &Acc128, frags: &Frags64, desc_b: u64, #[comptime] chain: Chain) -> Acc128 {
    let body = comptime![chain.ptx()];
    let old = load::<Acc128>(acc);
    let a = load::<Frags64>(frags);
    let out: Acc128;
    gpu_asm!("{body}", "// {d} {c} {a} {b}", d = out(_) out, c = in(_) old, a = in(_) a, b = in(_) desc_b);
    out
}

/// Issues a fresh `m64n128` chain (both operands in shared memory) without waiting: the result
/// is in flight until [`settle_128`].
#[cube]
pub(crate) fn issue_128_fresh(desc_a: u64, desc_b: u64, #[comptime] chain: Chain) -> Acc128 {
    let body = comptime![chain.issue_ptx()];
    let out: Acc128;
    gpu_asm!("{body}", "// {d} {a} {b}", d = out(_) out, a = in(_) desc_a, b = in(_) desc_b);
    out
}

/// Issues `acc + A·B` for an `m64n128` chain 128 deep, A from registers, without waiting: the
/// result and `frags` are in flight until [`settle_128_wide`].
#[cube]
pub(crate) fn issue_128_wide(acc: &Acc128, frags: &Frags128, desc_b: u64, #[comptime] chain: Chain) -> Acc128 {
    let body = comptime![chain.issue_ptx()];
    let old = load::<Acc128>(acc);
    let a = load::<Frags128>(frags);
    let out: Acc128;
    gpu_asm!("{body}", "// {d} {c} {a} {b}", d = out(_) out, c = in(_) old, a = in(_) a, b = in(_) desc_b);
    out
}

/// An [`issue_128_fresh`] result, once at most `pending` issued chains are still in flight.
#[cube]
pub(crate) fn settle_128(x: &Acc128, #[comptime] pending: u32) -> Acc128 {
    let body = comptime![settle_ptx(pending, 64)];
    let old = load::<Acc128>(x);
    let out: Acc128;
    gpu_asm!("{body}", "// {d} {c}", d = out(_) out, c = in(_) old);
    out
}

/// An [`issue_128_wide`] result, once at most `pending` issued chains are still in flight;
/// `frags`, that chain's A operand, is held until then.
#[cube]
pub(crate) fn settle_128_wide(acc: &Acc128, frags: &Frags128, #[comptime] pending: u32) -> Acc128 {
    let body = comptime![settle_ptx(pending, 64)];
    let old = load::<Acc128>(acc);
    let a = load::<Frags128>(frags);
    let out: Acc128;
    gpu_asm!("{body}", "// {d} {c} {a}", d = out(_) out, c = in(_) old, a = in(_) a);
    out
}

/// A value in a mutable local would reach `gpu_asm!` as its address: this loads it, so the asm
/// gets its registers.
#[cube]
pub(crate) fn load<V: CubeType<ExpandType: ReadValue> + CubePrimitive>(value: &V) -> V {
    intrinsic!(|scope| value.read_value(scope).into())
}

/// 2ˣ (`ex2.approx`: 2 ulp; -inf gives 0).
#[cube]
pub(crate) fn exp2(x: f32) -> f32 {
    let out: f32;
    gpu_asm!("ex2.approx.ftz.f32 {out}, {x};", out = out(_) out, x = in(_) x, options(pure, nomem));
    out
}

/// tanh x (`tanh.approx`: one MUFU instruction, about 2⁻¹¹ relative).
#[cube]
pub(crate) fn tanh_approx(x: f32) -> f32 {
    let out: f32;
    gpu_asm!("tanh.approx.f32 {out}, {x};", out = out(_) out, x = in(_) x, options(pure, nomem));
    out
}

/// 1 / x (`rcp.approx`: 1 ulp; 1 / inf gives 0).
#[cube]
pub(crate) fn recip_approx(x: f32) -> f32 {
    let out: f32;
    gpu_asm!("rcp.approx.ftz.f32 {out}, {x};", out = out(_) out, x = in(_) x, options(pure, nomem));
    out
}

/// log₂ x (`lg2.approx`).
#[cube]
pub(crate) fn log2(x: f32) -> f32 {
    let out: f32;
    gpu_asm!("lg2.approx.ftz.f32 {out}, {x};", out = out(_) out, x = in(_) x, options(pure, nomem));
    out
}

/// Two f32 as the bf16 pair of one A-fragment register, `lo` in the low half.
#[cube]
pub(crate) fn pack_bf16(lo: f32, hi: f32) -> u32 {
    let out: u32;
    gpu_asm!("cvt.rn.bf16x2.f32 {out}, {hi}, {lo};", out = out(_) out, hi = in(_) hi, lo = in(_) lo, options(pure, nomem));
    out
}

/// A shared-memory matrix descriptor: the start address in 16-byte units, then `bits`
/// ([`Tile::descriptor_bits`]).
#[cube]
pub(crate) fn descriptor(smem_addr: u32, #[comptime] tile: Tile) -> u64 {
    u64::cast_from((smem_addr >> 4) & 0x3FFF) | comptime!(tile.descriptor_bits())
}

/// Lowers this warpgroup's registers to `count` a thread (`setmaxnreg.dec`), returning the rest
/// to the block's pool; every thread of the warpgroup runs it.
#[cube]
pub(crate) fn release_registers(#[comptime] count: u32) {
    gpu_asm!("setmaxnreg.dec.sync.aligned.u32 {count};");
}

/// Raises this warpgroup's registers to `count` a thread (`setmaxnreg.inc`), waiting until the
/// pool holds them; every thread of the warpgroup runs it.
#[cube]
pub(crate) fn claim_registers(#[comptime] count: u32) {
    gpu_asm!("setmaxnreg.inc.sync.aligned.u32 {count};");
}

#[cube]
pub(crate) fn mbarrier_init(bar: u32, #[comptime] count: u32) {
    gpu_asm!("mbarrier.init.shared::cta.b64 [{bar}], {count};", bar = in(_) bar);
}

/// Makes the initialized barriers visible to the TMA engine; a `sync_cube` must follow.
#[cube]
pub(crate) fn mbarrier_init_fence() {
    gpu_asm!("fence.mbarrier_init.release.cluster;");
}

#[cube]
pub(crate) fn mbarrier_arrive(bar: u32) {
    gpu_asm!("mbarrier.arrive.shared::cta.b64 _, [{bar}];", bar = in(_) bar);
}

/// Arrives and announces `bytes` of TMA traffic the phase also waits for.
#[cube]
pub(crate) fn mbarrier_expect(bar: u32, #[comptime] bytes: u32) {
    gpu_asm!("mbarrier.arrive.expect_tx.shared::cta.b64 _, [{bar}], {bytes};", bar = in(_) bar);
}

/// Spins until the phase of `bar` with this parity has completed.
#[cube]
pub(crate) fn mbarrier_wait(bar: u32, parity: u32) {
    loop {
        let done: u32;
        gpu_asm!(
            "{{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [{bar}], {parity};\nselp.u32 {done}, 1, 0, p;\n}}",
            done = out(_) done, bar = in(_) bar, parity = in(_) parity,
        );
        if done != 0 {
            break;
        }
    }
}

/// The address of a tensor map the kernel writes through (`tensor_map_address` takes only maps
/// it reads), for [`tma_store_box`].
#[cube]
pub(crate) fn store_map_address<T: CubePrimitive>(map: &mut TensorMap<T, Tiled>) -> u64 {
    intrinsic!(|scope| {
        let addr = cubecl_cpp::cuda::ptx::TensorMapAddrOp::new(scope.ctx_mut(), map.value(scope));
        scope.register_with_result(&addr).into()
    })
}

/// Stores 4 bytes at a shared-memory address. `value` is often another asm statement's output,
/// which CubeCL keeps in a mutable local: [`load`] hands over its value, not its address (the
/// address is what the first build stored, seen in CubeCL's generated source).
#[cube]
pub(crate) fn st_shared_u32(addr: u32, value: u32) {
    let value = load::<u32>(&value);
    gpu_asm!("st.shared.b32 [{addr}], {value};", addr = in(_) addr, value = in(_) value);
}

/// Loads 4 bytes from a shared-memory address.
#[cube]
pub(crate) fn ld_shared_u32(addr: u32) -> u32 {
    let out: u32;
    gpu_asm!("ld.shared.b32 {out}, [{addr}];", out = out(_) out, addr = in(_) addr);
    out
}

/// Stores two f32 (8 bytes) at a shared-memory address.
#[cube]
pub(crate) fn st_shared_v2_f32(addr: u32, a: f32, b: f32) {
    let (a, b) = (load::<f32>(&a), load::<f32>(&b));
    gpu_asm!("st.shared.v2.f32 [{addr}], {{{a}, {b}}};", addr = in(_) addr, a = in(_) a, b = in(_) b);
}

/// Makes this thread's shared-memory writes visible to the TMA engine (the async proxy).
#[cube]
pub(crate) fn fence_proxy_async_shared() {
    gpu_asm!("fence.proxy.async.shared::cta;");
}

/// Waits until `threads` threads (whole warps) have arrived at named barrier `id` (0 is
/// `sync_cube`'s).
#[cube]
pub(crate) fn named_barrier(id: u32, #[comptime] threads: u32) {
    gpu_asm!("bar.sync {id}, {threads};", id = in(_) id);
}

/// A 2-D bulk tensor copy from shared memory `src` to the box at `(inner, outer)` of `map`'s
/// tensor, in this thread's current bulk group; out-of-range parts of the box are not written.
#[cube]
pub(crate) fn tma_store_box(map: u64, inner: u32, outer: u32, src: u32) {
    gpu_asm!(
        "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [{map}, {{{inner}, {outer}}}], [{src}];",
        map = in(_) map, inner = in(_) inner, outer = in(_) outer, src = in(_) src,
    );
}

/// Adds the f32 box at `src` in shared memory into the box at `(inner, outer)` of `map`'s tensor
/// (a 2-D bulk tensor reduction, atomic element by element), in this thread's current bulk group;
/// out-of-range parts of the box are left alone.
#[cube]
pub(crate) fn tma_reduce_add_box(map: u64, inner: u32, outer: u32, src: u32) {
    gpu_asm!(
        "cp.reduce.async.bulk.tensor.2d.global.shared::cta.add.tile.bulk_group [{map}, {{{inner}, {outer}}}], [{src}];",
        map = in(_) map, inner = in(_) inner, outer = in(_) outer, src = in(_) src,
    );
}

/// Closes this thread's current bulk group.
#[cube]
pub(crate) fn bulk_commit() {
    gpu_asm!("cp.async.bulk.commit_group;");
}

/// Waits until every bulk group of this thread has finished reading its shared memory.
#[cube]
pub(crate) fn bulk_wait_read() {
    gpu_asm!("cp.async.bulk.wait_group.read 0;");
}

/// Waits until every bulk group of this thread but the last committed has finished reading its
/// shared memory (double-buffered stores: the other buffer is free).
#[cube]
pub(crate) fn bulk_wait_read_but_last() {
    gpu_asm!("cp.async.bulk.wait_group.read 1;");
}

/// Waits until every bulk group of this thread is complete, its writes done.
#[cube]
pub(crate) fn bulk_wait() {
    gpu_asm!("cp.async.bulk.wait_group 0;");
}

/// A 2-D bulk tensor copy of the box at `(inner, outer)` into shared memory, counted on `bar`.
#[cube]
pub(crate) fn tma_load_2d(dst: u32, map: u64, inner: u32, outer: u32, bar: u32) {
    gpu_asm!(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [{dst}], [{map}, {{{inner}, {outer}}}], [{bar}];",
        dst = in(_) dst, map = in(_) map, inner = in(_) inner, outer = in(_) outer, bar = in(_) bar,
    );
}

/// A 4-D bulk tensor copy (coordinates innermost first), counted on `bar`.
#[cube]
pub(crate) fn tma_load_4d(dst: u32, map: u64, c0: u32, c1: u32, c2: u32, c3: u32, bar: u32) {
    gpu_asm!(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [{dst}], [{map}, {{{c0}, {c1}, {c2}, {c3}}}], [{bar}];",
        dst = in(_) dst, map = in(_) map, c0 = in(_) c0, c1 = in(_) c1, c2 = in(_) c2, c3 = in(_) c3, bar = in(_) bar,
    );
}
