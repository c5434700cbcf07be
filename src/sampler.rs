//! Which samples each rank sees in an epoch, with the semantics of torch's
//! `DistributedSampler`: `ceil(N / R)` samples per rank (the index list padded by wrapping
//! around, or truncated to `floor(N / R)` per rank with `drop_last`), an optional shuffle seeded
//! with `seed + epoch`, and the strided slice `indices[rank::R]`.
//!
//! The shuffle is a Fisher-Yates permutation driven by splitmix64: deterministic and identical
//! on every rank, but not the permutation torch's `torch.randperm` produces.

use crate::model::SplitMix;

#[derive(Debug, Clone)]
pub struct DistributedSampler {
    len: usize,
    num_replicas: usize,
    rank: usize,
    shuffle: bool,
    seed: u64,
    drop_last: bool,
    epoch: u64,
}

impl DistributedSampler {
    /// A shuffling sampler over `len` samples for `rank` of `num_replicas` (seed 0, epoch 0).
    pub fn new(len: usize, num_replicas: usize, rank: usize) -> Self {
        assert!(num_replicas > 0 && rank < num_replicas, "rank {rank} outside {num_replicas} replicas");
        Self { len, num_replicas, rank, shuffle: true, seed: 0, drop_last: false, epoch: 0 }
    }
    pub fn shuffle(mut self, on: bool) -> Self {
        self.shuffle = on;
        self
    }
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }
    pub fn drop_last(mut self, on: bool) -> Self {
        self.drop_last = on;
        self
    }
    /// Selects the epoch, which reseeds the shuffle (call it before each epoch, as in torch).
    pub fn set_epoch(&mut self, epoch: u64) {
        self.epoch = epoch;
    }
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Samples this rank gets per epoch.
    pub fn num_samples(&self) -> usize {
        if self.drop_last && !self.len.is_multiple_of(self.num_replicas) {
            self.len / self.num_replicas
        } else {
            self.len.div_ceil(self.num_replicas)
        }
    }

    /// Samples all ranks together get per epoch.
    pub fn total_size(&self) -> usize {
        self.num_samples() * self.num_replicas
    }

    /// This rank's sample indices for the current epoch, in order.
    pub fn indices(&self) -> Vec<usize> {
        let mut all: Vec<usize> = (0..self.len).collect();
        if self.shuffle {
            let mut rng = SplitMix(self.seed.wrapping_add(self.epoch));
            for i in (1..all.len()).rev() {
                let j = rng.below(i as u64 + 1) as usize;
                all.swap(i, j);
            }
        }
        let total = self.total_size();
        if total > all.len() && !all.is_empty() {
            // Pad by wrapping around (repeatedly if the padding exceeds the data).
            let base = all.clone();
            while all.len() < total {
                let take = (total - all.len()).min(base.len());
                all.extend_from_slice(&base[..take]);
            }
        }
        all.truncate(total);
        all.into_iter().skip(self.rank).step_by(self.num_replicas).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_partition_the_padded_epoch() {
        for (len, r) in [(10usize, 3usize), (12, 4), (5, 8), (1, 2), (100, 7)] {
            let per: Vec<Vec<usize>> = (0..r).map(|k| DistributedSampler::new(len, r, k).seed(7).indices()).collect();
            assert!(per.iter().all(|v| v.len() == len.div_ceil(r)));
            let mut seen: Vec<usize> = per.concat();
            seen.sort_unstable();
            seen.dedup();
            assert_eq!(seen.len(), len, "every sample is seen at least once");
        }
    }

    #[test]
    fn unshuffled_order_is_torch_strided_with_wraparound_padding() {
        // torch: list(range(10)) + [0, 1] then [rank::3]
        let s = |k| DistributedSampler::new(10, 3, k).shuffle(false).indices();
        assert_eq!(s(0), vec![0, 3, 6, 9]);
        assert_eq!(s(1), vec![1, 4, 7, 0]);
        assert_eq!(s(2), vec![2, 5, 8, 1]);
    }

    #[test]
    fn drop_last_truncates_to_floor() {
        let s = DistributedSampler::new(10, 3, 2).shuffle(false).drop_last(true);
        assert_eq!(s.num_samples(), 3);
        assert_eq!(s.indices(), vec![2, 5, 8]);
    }

    #[test]
    fn shuffle_depends_on_seed_plus_epoch_only() {
        let mut a = DistributedSampler::new(50, 2, 1).seed(3);
        let b = DistributedSampler::new(50, 2, 1).seed(4);
        a.set_epoch(1);
        assert_eq!(a.indices(), b.indices(), "seed 3 epoch 1 == seed 4 epoch 0");
        a.set_epoch(2);
        assert_ne!(a.indices(), b.indices());
    }
}
