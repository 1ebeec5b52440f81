//! Deterministic test data, identical in every process and on every device.

use burn::tensor::{DType, Device, Int, Shape, Tensor, TensorData};

/// Values in [-1, 1) from a hash of (seed, index): the same on every rank and process.
pub fn fixed<const D: usize>(shape: [usize; D], seed: u64, device: &Device, dtype: DType) -> Tensor<D> {
    let n: usize = shape.iter().product();
    let values: Vec<f32> = (0..n as u64)
        .map(|i| {
            let mut h = (i ^ seed.wrapping_mul(0x9E37_79B9_7F4A_7C15)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            h ^= h >> 31;
            h = h.wrapping_mul(0x94D0_49BB_1331_11EB);
            ((h >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect();
    Tensor::<1>::from_data(TensorData::new(values, [n]), (device, dtype)).reshape(shape)
}

/// Small integers `base + (i mod 7)`: exact in every float dtype when summed over a few ranks.
pub fn small_ints<const D: usize>(shape: [usize; D], base: i64, device: &Device, dtype: DType) -> Tensor<D> {
    ints(shape, base, device).float().cast(dtype)
}

/// Integers `base + (i mod 7)`.
pub fn ints<const D: usize>(shape: [usize; D], base: i64, device: &Device) -> Tensor<D, Int> {
    let n: usize = shape.iter().product();
    let values: Vec<i64> = (0..n as i64).map(|i| base + i % 7).collect();
    Tensor::<1, Int>::from_data(TensorData::new(values, [n]), device).reshape(Shape::from(shape))
}

/// Asserts `actual` is within `tolerance` of `expected`, relative to the size of `expected`.
pub fn assert_close<const D: usize>(actual: &Tensor<D>, expected: &Tensor<D>, tolerance: f64, what: &str) {
    assert_eq!(actual.dims(), expected.dims(), "{what}: shapes differ");
    let a = actual.to_data().convert::<f64>().try_to_vec::<f64>().expect("f64");
    let e = expected.to_data().convert::<f64>().try_to_vec::<f64>().expect("f64");
    let scale = e.iter().map(|v| v.abs()).fold(1e-12, f64::max);
    let worst = a.iter().zip(&e).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max);
    assert!(
        a.iter().all(|v| v.is_finite()) && worst <= tolerance * scale,
        "{what}: max |difference| {worst:e} exceeds {tolerance:e} × {scale:e}"
    );
}

/// Asserts two tensors are equal, value for value.
pub fn assert_exact<const D: usize>(actual: &Tensor<D>, expected: &Tensor<D>, what: &str) {
    assert_close(actual, expected, 0.0, what);
}

/// The values of an integer tensor of any integer dtype.
pub fn int_values<const D: usize>(x: Tensor<D, Int>) -> Vec<i64> {
    x.into_data()
        .convert::<i64>()
        .try_to_vec::<i64>()
        .expect("integer data")
}
