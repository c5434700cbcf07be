//! Element types the collectives move and reduce, and the reduction kernels on them.

/// Element types on the wire and in shared memory (native endianness: one host or like hosts).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum DType {
    F32 = 1,
    F64 = 2,
    I32 = 3,
    I64 = 4,
    U8 = 5,
}

impl DType {
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::U8 => "u8",
        }
    }
    pub(crate) fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            1 => DType::F32,
            2 => DType::F64,
            3 => DType::I32,
            4 => DType::I64,
            5 => DType::U8,
            _ => return None,
        })
    }
}

/// How `all_reduce` and `reduce_scatter` combine the ranks' values. `Avg` sums, then divides
/// by the world size once (integer division for integers).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum ReduceOp {
    Sum = 0,
    Avg = 1,
    Min = 2,
    Max = 3,
}

impl ReduceOp {
    pub(crate) fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            0 => ReduceOp::Sum,
            1 => ReduceOp::Avg,
            2 => ReduceOp::Min,
            3 => ReduceOp::Max,
            _ => return None,
        })
    }
}

/// A plain-old-data number the collectives can reduce.
///
/// # Safety
/// Implementors must be `Copy` types with no padding and no invalid bit patterns, so that any
/// byte image received from a peer is a valid value.
pub unsafe trait Element: Copy + Send + Sync + Default + PartialOrd + std::fmt::Debug + 'static {
    const DTYPE: DType;
    fn add(a: Self, b: Self) -> Self;
    fn div_count(a: Self, n: usize) -> Self;

    /// `dst[i] = dst[i] (op) src[i]` (`Avg` sums).
    #[inline]
    fn reduce_into(dst: &mut [Self], src: &[Self], op: ReduceOp) {
        debug_assert_eq!(dst.len(), src.len());
        match op {
            ReduceOp::Sum | ReduceOp::Avg => dst.iter_mut().zip(src).for_each(|(d, s)| *d = Self::add(*d, *s)),
            ReduceOp::Min => dst.iter_mut().zip(src).for_each(|(d, s)| {
                if *s < *d {
                    *d = *s
                }
            }),
            ReduceOp::Max => dst.iter_mut().zip(src).for_each(|(d, s)| {
                if *s > *d {
                    *d = *s
                }
            }),
        }
    }

    /// `dst = srcs[0] (op) srcs[1] (op) ...`, in source order (deterministic), block by block
    /// so that the partial result stays in L1.
    fn reduce_many(dst: &mut [Self], srcs: &[&[Self]], op: ReduceOp) {
        const BLOCK: usize = 2048;
        let n = dst.len();
        let mut start = 0;
        while start < n {
            let end = (start + BLOCK).min(n);
            let d = &mut dst[start..end];
            d.copy_from_slice(&srcs[0][start..end]);
            for s in &srcs[1..] {
                Self::reduce_into(d, &s[start..end], op);
            }
            start = end;
        }
    }

    /// Divides every element by `n` (the `Avg` epilogue).
    fn scale(buf: &mut [Self], n: usize) {
        buf.iter_mut().for_each(|x| *x = Self::div_count(*x, n));
    }
}

// SAFETY: f32 is plain old data: 4 bytes, no padding, every bit pattern valid.
unsafe impl Element for f32 {
    const DTYPE: DType = DType::F32;
    #[inline]
    fn add(a: Self, b: Self) -> Self {
        a + b
    }
    fn div_count(a: Self, n: usize) -> Self {
        a * (1.0 / n as f32)
    }
    fn scale(buf: &mut [Self], n: usize) {
        let k = 1.0 / n as f32;
        buf.iter_mut().for_each(|x| *x *= k);
    }
}

// SAFETY: f64 is plain old data: 8 bytes, no padding, every bit pattern valid.
unsafe impl Element for f64 {
    const DTYPE: DType = DType::F64;
    #[inline]
    fn add(a: Self, b: Self) -> Self {
        a + b
    }
    fn div_count(a: Self, n: usize) -> Self {
        a * (1.0 / n as f64)
    }
}

// SAFETY: i32 is plain old data: 4 bytes, no padding, every bit pattern valid.
unsafe impl Element for i32 {
    const DTYPE: DType = DType::I32;
    #[inline]
    fn add(a: Self, b: Self) -> Self {
        a.wrapping_add(b)
    }
    fn div_count(a: Self, n: usize) -> Self {
        a / n as i32
    }
}

// SAFETY: i64 is plain old data: 8 bytes, no padding, every bit pattern valid.
unsafe impl Element for i64 {
    const DTYPE: DType = DType::I64;
    #[inline]
    fn add(a: Self, b: Self) -> Self {
        a.wrapping_add(b)
    }
    fn div_count(a: Self, n: usize) -> Self {
        a / n as i64
    }
}

// SAFETY: u8 is plain old data: 1 byte, every bit pattern valid.
unsafe impl Element for u8 {
    const DTYPE: DType = DType::U8;
    #[inline]
    fn add(a: Self, b: Self) -> Self {
        a.wrapping_add(b)
    }
    fn div_count(a: Self, n: usize) -> Self {
        (a as usize / n) as u8
    }
}

/// The bytes of a slice of elements.
pub(crate) fn as_bytes<T: Element>(s: &[T]) -> &[u8] {
    // SAFETY: Element types are plain old data without padding, so their memory is initialised
    // bytes; the length covers exactly the slice.
    unsafe { std::slice::from_raw_parts(s.as_ptr().cast::<u8>(), std::mem::size_of_val(s)) }
}

/// The bytes of a mutable slice of elements; any bytes written are valid elements.
pub(crate) fn as_bytes_mut<T: Element>(s: &mut [T]) -> &mut [u8] {
    // SAFETY: as in `as_bytes`, and every bit pattern is a valid `T` (trait contract), so
    // writes through the byte view cannot create invalid values.
    unsafe { std::slice::from_raw_parts_mut(s.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(s)) }
}

/// Elements viewed in an aligned byte buffer (length rounded down to whole elements).
pub(crate) fn from_bytes<T: Element>(b: &[u8]) -> &[T] {
    let size = std::mem::size_of::<T>();
    assert_eq!(b.as_ptr() as usize % std::mem::align_of::<T>(), 0, "scratch buffer is aligned");
    // SAFETY: aligned (asserted), in bounds (length rounded down), and every bit pattern is a
    // valid T (Element contract).
    unsafe { std::slice::from_raw_parts(b.as_ptr().cast::<T>(), b.len() / size) }
}
