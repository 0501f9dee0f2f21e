//! The memory backend and its raw baseline: a `Mutex<HashMap>` insert then update.

use crate::harness::{self, Backend, RawBaseline};
use crate::harness::{Filled, Kind, Scaling};
use async_trait::async_trait;
use idempotency_core::store::BoxError;
use idempotency_core::RecordId;
use idempotency_memory::MemoryStore;
use parking_lot::Mutex;
use std::any::Any;
use std::collections::HashMap;
use std::sync::Arc;

#[derive(Default)]
pub(crate) struct RawMemory {
    map: Mutex<HashMap<String, (bool, Vec<u8>)>>,
}

#[async_trait]
impl RawBaseline for RawMemory {
    async fn new_key_cycle(&self, key: &str, outcome: &[u8]) -> Result<(), BoxError> {
        let inserted = self
            .map
            .lock()
            .insert(key.to_owned(), (false, Vec::new()))
            .is_none();
        if !inserted {
            return Err("key existed".into());
        }
        if let Some(entry) = self.map.lock().get_mut(key) {
            *entry = (true, outcome.to_vec());
        }
        Ok(())
    }

    async fn replay(&self, key: &str) -> Result<Option<Vec<u8>>, BoxError> {
        Ok(self.map.lock().get(key).map(|(_, o)| o.clone()))
    }
}

pub(crate) fn backend() -> Backend {
    Backend {
        name: "memory",
        store: Arc::new(MemoryStore::new()),
        raw: Arc::new(RawMemory::default()),
        round_trips: None,
        limit: None,
    }
}

/// The memory store in the bench.
pub(crate) const KIND: Kind = Kind {
    name: "memory",
    make: |_| Box::pin(async { Ok(vec![(backend(), Box::new(()) as Box<dyn Any>)]) }),
    scaling: Some(Scaling {
        max_keys: usize::MAX,
        filled: |n| Box::pin(filled(n)),
        in_process_memory: true,
    }),
};

/// A memory store holding `n` completed records.
async fn filled(n: usize) -> Result<Filled, BoxError> {
    let store = Arc::new(MemoryStore::new());
    for i in 0..n {
        let id = RecordId::new(harness::key("fill", 0, i), harness::scope());
        harness::store_cycle(store.as_ref(), id).await?;
    }
    Ok((store, Box::new(())))
}
