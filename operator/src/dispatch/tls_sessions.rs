//! The operator's TLS session cache for agent connections: one TLS 1.3 ticket per agent.
//!
//! rustls' `ClientSessionMemoryCache` keeps up to eight tickets per server in a buffer
//! allocated for eight, and counts its capacity in tickets: sized for 8,192 agents it
//! preallocates for 65,536 tickets, about 2.5 KiB per agent once filled. A node's capture
//! needs one ticket (the start's full handshake leaves one; the collection resumes with it
//! and the agent sends the next), so this cache keeps the newest ticket of each agent and
//! the key-exchange group it chose, nothing else: ~1 KiB per agent, most of it the
//! agent's certificate chain, which a resumed session carries.
//!
//! TLS 1.2 sessions are not kept: agents speak TLS 1.3 (`node-agent/src/service/tls.rs`).
//! When full, the agent added first is forgotten (as in rustls).

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

use rustls::NamedGroup;
use rustls::client::{ClientSessionStore, Tls12ClientSessionValue, Tls13ClientSessionValue};
use rustls::pki_types::ServerName;

#[derive(Default)]
struct Agent {
    kx_hint: Option<NamedGroup>,
    ticket: Option<Tls13ClientSessionValue>,
}

#[derive(Default)]
struct Inner {
    agents: HashMap<ServerName<'static>, Agent>,
    /// Insertion order, for eviction.
    order: VecDeque<ServerName<'static>>,
}

/// One TLS 1.3 ticket per agent, for at most `capacity` agents.
pub struct AgentSessions {
    capacity: usize,
    inner: Mutex<Inner>,
}

impl std::fmt::Debug for AgentSessions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentSessions")
            .field("capacity", &self.capacity)
            .field("agents", &self.len())
            .finish()
    }
}

impl AgentSessions {
    /// A cache for at most `capacity` agents (at least one).
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            inner: Mutex::new(Inner::default()),
        }
    }

    /// Agents with an entry.
    pub fn len(&self) -> usize {
        self.lock().agents.len()
    }

    /// No agent has an entry.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Applies `f` to `server`'s entry, creating it (and evicting the oldest agent when
    /// full) if there is none.
    fn with_agent(&self, server: ServerName<'static>, f: impl FnOnce(&mut Agent)) {
        let mut inner = self.lock();
        if let Some(agent) = inner.agents.get_mut(&server) {
            f(agent);
            return;
        }
        while inner.agents.len() >= self.capacity {
            let Some(oldest) = inner.order.pop_front() else {
                break;
            };
            inner.agents.remove(&oldest);
        }
        let mut agent = Agent::default();
        f(&mut agent);
        inner.order.push_back(server.clone());
        inner.agents.insert(server, agent);
    }
}

impl ClientSessionStore for AgentSessions {
    fn set_kx_hint(&self, server_name: ServerName<'static>, group: NamedGroup) {
        self.with_agent(server_name, |a| a.kx_hint = Some(group));
    }

    fn kx_hint(&self, server_name: &ServerName<'_>) -> Option<NamedGroup> {
        self.lock()
            .agents
            .get(&server_name.to_owned())
            .and_then(|a| a.kx_hint)
    }

    fn set_tls12_session(
        &self,
        _server_name: ServerName<'static>,
        _value: Tls12ClientSessionValue,
    ) {
    }

    fn tls12_session(&self, _server_name: &ServerName<'_>) -> Option<Tls12ClientSessionValue> {
        None
    }

    fn remove_tls12_session(&self, _server_name: &ServerName<'static>) {}

    fn insert_tls13_ticket(
        &self,
        server_name: ServerName<'static>,
        value: Tls13ClientSessionValue,
    ) {
        self.with_agent(server_name, |a| a.ticket = Some(value));
    }

    fn take_tls13_ticket(
        &self,
        server_name: &ServerName<'static>,
    ) -> Option<Tls13ClientSessionValue> {
        self.lock()
            .agents
            .get_mut(server_name)
            .and_then(|a| a.ticket.take())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(i: usize) -> ServerName<'static> {
        ServerName::try_from(format!("node-{i}.agent.flamefleet.invalid")).unwrap()
    }

    #[test]
    fn keeps_at_most_capacity_agents_and_forgets_the_oldest() {
        let cache = AgentSessions::new(3);
        for i in 0..5 {
            cache.set_kx_hint(name(i), NamedGroup::X25519);
        }
        assert_eq!(cache.len(), 3);
        assert_eq!(cache.kx_hint(&name(0)), None);
        assert_eq!(cache.kx_hint(&name(1)), None);
        assert_eq!(cache.kx_hint(&name(4)), Some(NamedGroup::X25519));
        // Updating a known agent evicts nobody.
        cache.set_kx_hint(name(2), NamedGroup::secp256r1);
        assert_eq!(cache.len(), 3);
        assert_eq!(cache.kx_hint(&name(2)), Some(NamedGroup::secp256r1));
        assert!(cache.take_tls13_ticket(&name(2)).is_none());
        assert!(cache.tls12_session(&name(2)).is_none());
    }
}
