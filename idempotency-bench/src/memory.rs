//! The memory backend and its raw baseline: a `Mutex<HashMap>` insert then update.

use crate::harness::{Backend, RawBaseline};
use async_trait::async_trait;
use idempotency_core::BoxError;
use idempotency_memory::MemoryStore;
use parking_lot::Mutex;
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
