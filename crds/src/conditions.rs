//! Setting `metav1.Condition`s the way Kubernetes controllers do.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

/// Condition status `"True"`.
pub const TRUE: &str = "True";
/// Condition status `"False"`.
pub const FALSE: &str = "False";
/// Condition status `"Unknown"`.
pub const UNKNOWN: &str = "Unknown";

/// Builds a condition; `status` is `"True"`/`"False"` from the bool.
pub fn new_condition(
    type_: &str,
    status: bool,
    reason: &str,
    message: impl Into<String>,
    observed_generation: Option<i64>,
    now: Time,
) -> Condition {
    Condition {
        type_: type_.to_string(),
        status: if status { TRUE } else { FALSE }.to_string(),
        reason: reason.to_string(),
        message: message.into(),
        observed_generation,
        last_transition_time: now,
    }
}

/// Inserts or replaces the condition of `new.type_`, like apimachinery's `SetStatusCondition`.
///
/// `lastTransitionTime` is kept from the existing condition when the status did not change,
/// so it records when the status last flipped rather than when we last wrote it.
/// Returns true when anything changed.
pub fn set_condition(conditions: &mut Vec<Condition>, mut new: Condition) -> bool {
    match conditions.iter_mut().find(|c| c.type_ == new.type_) {
        None => {
            conditions.push(new);
            true
        }
        Some(existing) => {
            if existing.status == new.status {
                new.last_transition_time = existing.last_transition_time.clone();
            }
            let changed = *existing != new;
            *existing = new;
            changed
        }
    }
}

/// The condition of the given type, if present.
pub fn find_condition<'a>(conditions: &'a [Condition], type_: &str) -> Option<&'a Condition> {
    conditions.iter().find(|c| c.type_ == type_)
}

/// True when the condition of the given type is present with status `"True"`.
pub fn is_condition_true(conditions: &[Condition], type_: &str) -> bool {
    find_condition(conditions, type_).is_some_and(|c| c.status == TRUE)
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::jiff::Timestamp;

    fn at(secs: i64) -> Time {
        Time(Timestamp::from_second(secs).unwrap())
    }

    #[test]
    fn inserts_then_keeps_transition_time_while_status_is_unchanged() {
        let mut conds = Vec::new();
        assert!(set_condition(
            &mut conds,
            new_condition("Ready", false, "Resolving", "finding pods", Some(1), at(10))
        ));
        assert!(set_condition(
            &mut conds,
            new_condition("Ready", false, "Capturing", "2 nodes", Some(1), at(20))
        ));
        assert_eq!(conds.len(), 1);
        assert_eq!(conds[0].reason, "Capturing");
        assert_eq!(conds[0].last_transition_time, at(10));

        assert!(set_condition(
            &mut conds,
            new_condition("Ready", true, "Done", "ok", Some(1), at(30))
        ));
        assert_eq!(conds[0].last_transition_time, at(30));
        assert!(is_condition_true(&conds, "Ready"));
    }

    #[test]
    fn reports_no_change_for_an_identical_condition() {
        let mut conds = Vec::new();
        set_condition(&mut conds, new_condition("A", true, "R", "m", None, at(1)));
        assert!(!set_condition(
            &mut conds,
            new_condition("A", true, "R", "m", None, at(99))
        ));
        set_condition(&mut conds, new_condition("B", false, "R", "m", None, at(1)));
        assert_eq!(conds.len(), 2);
        assert!(!is_condition_true(&conds, "B"));
        assert!(find_condition(&conds, "C").is_none());
    }
}
