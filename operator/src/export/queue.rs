//! The export queue: bounded in all and per namespace, served round-robin over namespaces,
//! so that one tenant's flood of captures can neither exhaust the queue for the others nor
//! make them wait behind it.

use std::collections::{HashMap, VecDeque};

/// Why an item was not queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// The whole queue is at its capacity.
    QueueFull,
    /// The item's namespace has its share of the queue already.
    NamespaceFull,
}

impl Refused {
    /// The `reason` label of the drop counter.
    pub fn reason(self) -> &'static str {
        match self {
            Self::QueueFull => "queue_full",
            Self::NamespaceFull => "namespace_full",
        }
    }
}

/// A queue of at most `capacity` items in all and `per_namespace` per namespace; [`pop`]
/// takes one item of each waiting namespace in turn (oldest first within a namespace).
///
/// [`pop`]: FairQueue::pop
#[derive(Debug)]
pub struct FairQueue<T> {
    items: HashMap<String, VecDeque<T>>,
    /// Namespaces with items, in the order they are served next.
    turns: VecDeque<String>,
    len: usize,
    capacity: usize,
    per_namespace: usize,
}

impl<T> FairQueue<T> {
    /// An empty queue (a bound of 0 is taken as 1).
    pub fn new(capacity: usize, per_namespace: usize) -> Self {
        Self {
            items: HashMap::new(),
            turns: VecDeque::new(),
            len: 0,
            capacity: capacity.max(1),
            per_namespace: per_namespace.max(1),
        }
    }

    /// Items queued.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when nothing is queued.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Queues `item` of `namespace`, or refuses it (never waits).
    pub fn push(&mut self, namespace: &str, item: T) -> Result<(), Refused> {
        if self.len >= self.capacity {
            return Err(Refused::QueueFull);
        }
        let queue = self.items.entry(namespace.to_owned()).or_default();
        if queue.len() >= self.per_namespace {
            return Err(Refused::NamespaceFull);
        }
        if queue.is_empty() {
            self.turns.push_back(namespace.to_owned());
        }
        queue.push_back(item);
        self.len += 1;
        Ok(())
    }

    /// Puts back an item that was popped (it is being retried): at the end of its
    /// namespace's queue, whatever the bounds (it was admitted once; a caller that
    /// requeues only what it popped adds at most what it holds).
    pub fn requeue(&mut self, namespace: &str, item: T) {
        let queue = self.items.entry(namespace.to_owned()).or_default();
        if queue.is_empty() {
            self.turns.push_back(namespace.to_owned());
        }
        queue.push_back(item);
        self.len += 1;
    }

    /// The next item `ready` accepts, looking at the oldest item of each namespace in turn:
    /// the first namespace whose oldest item is ready gives it, and the namespaces passed
    /// over keep their place (served first once ready). `None` when no oldest item is ready.
    pub fn pop_first(&mut self, mut ready: impl FnMut(&T) -> bool) -> Option<(String, T)> {
        let position = self.turns.iter().position(|ns| {
            self.items
                .get(ns)
                .and_then(VecDeque::front)
                .is_some_and(&mut ready)
        })?;
        let namespace = self.turns.remove(position)?;
        let queue = self.items.get_mut(&namespace)?;
        let item = queue.pop_front()?;
        self.len -= 1;
        if queue.is_empty() {
            self.items.remove(&namespace);
        } else {
            self.turns.push_back(namespace.clone());
        }
        Some((namespace, item))
    }

    /// The oldest item of each namespace.
    pub fn fronts(&self) -> impl Iterator<Item = &T> {
        self.items.values().filter_map(VecDeque::front)
    }

    /// The next item: the oldest of the namespace whose turn it is.
    pub fn pop(&mut self) -> Option<(String, T)> {
        let namespace = self.turns.pop_front()?;
        let queue = self.items.get_mut(&namespace)?;
        let item = queue.pop_front()?;
        self.len -= 1;
        if queue.is_empty() {
            self.items.remove(&namespace);
        } else {
            self.turns.push_back(namespace.clone());
        }
        Some((namespace, item))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flooding_namespace_gets_its_share_and_no_more() {
        let mut q = FairQueue::new(10, 4);
        for i in 0..100 {
            let r = q.push("noisy", i);
            assert_eq!(r.is_ok(), i < 4, "item {i}");
            if i >= 4 {
                assert_eq!(r, Err(Refused::NamespaceFull));
            }
        }
        // The others still get in, and are served between the flood's items.
        q.push("quiet", 100).unwrap();
        q.push("calm", 200).unwrap();
        q.push("calm", 201).unwrap();
        let order: Vec<(String, i32)> = std::iter::from_fn(|| q.pop()).collect();
        let names: Vec<&str> = order.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            ["noisy", "quiet", "calm", "noisy", "calm", "noisy", "noisy"]
        );
        assert_eq!(order[0].1, 0);
        assert_eq!(order[3].1, 1);
        assert!(q.is_empty());
    }

    #[test]
    fn a_retried_item_goes_back_in_line_behind_the_others() {
        let mut q = FairQueue::new(2, 1);
        q.push("a", 1).unwrap();
        q.push("b", 2).unwrap();
        let (ns, item) = q.pop().unwrap();
        assert_eq!((ns.as_str(), item), ("a", 1));
        q.push("a", 3).unwrap();
        // Back in line even though "a" and the queue are at their bounds.
        q.requeue(&ns, item);
        assert_eq!(q.len(), 3);
        let order: Vec<(String, i32)> = std::iter::from_fn(|| q.pop()).collect();
        assert_eq!(order, [("b".into(), 2), ("a".into(), 3), ("a".into(), 1)]);
    }

    #[test]
    fn an_item_not_ready_holds_up_no_other_namespace() {
        let mut q = FairQueue::new(10, 4);
        q.push("a", (1, false)).unwrap();
        q.push("a", (2, true)).unwrap();
        q.push("b", (3, true)).unwrap();
        q.push("c", (4, true)).unwrap();
        // a's oldest is backing off: b's is next, then c's; a keeps its place in turn.
        let ready = |item: &(i32, bool)| item.1;
        assert_eq!(q.pop_first(ready).map(|(_, i)| i.0), Some(3));
        assert_eq!(q.fronts().filter(|i| !i.1).count(), 1);
        assert_eq!(q.pop_first(ready).map(|(_, i)| i.0), Some(4));
        assert_eq!(q.pop_first(ready), None);
        assert_eq!(q.len(), 2);
        // Once ready, a is served, oldest first.
        assert_eq!(q.pop_first(|_| true).map(|(_, i)| i.0), Some(1));
        assert_eq!(q.pop_first(|_| true).map(|(_, i)| i.0), Some(2));
        assert!(q.is_empty());
    }

    #[test]
    fn the_whole_queue_is_bounded_too() {
        let mut q = FairQueue::new(3, 2);
        q.push("a", 1).unwrap();
        q.push("a", 2).unwrap();
        q.push("b", 3).unwrap();
        assert_eq!(q.push("c", 4), Err(Refused::QueueFull));
        assert_eq!(q.len(), 3);
        assert_eq!(q.pop(), Some(("a".into(), 1)));
        q.push("c", 4).unwrap();
        let rest: Vec<i32> = std::iter::from_fn(|| q.pop()).map(|(_, i)| i).collect();
        assert_eq!(rest, [3, 2, 4]);
    }
}
