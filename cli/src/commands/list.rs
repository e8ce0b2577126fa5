//! `kubectl profile list` and `delete`.

use std::io::Write;

use flamefleet_api::ProfileRequest;

use crate::cluster::Cluster;
use crate::error::Result;
use crate::requests;

/// A kubectl-style age: `42s`, `5m`, `3h`, `2d`.
pub fn age(seconds: i64) -> String {
    match seconds.max(0) {
        s if s < 120 => format!("{s}s"),
        s if s < 7200 => format!("{}m", s / 60),
        s if s < 172_800 => format!("{}h", s / 3600),
        s => format!("{}d", s / 86_400),
    }
}

/// The table rows (header first) of `list`. A `TRIGGER` column (what fired a policy
/// trigger's run, `name: condition (measured, threshold)`) is added when any listed request
/// was triggered.
pub fn table(requests: &[ProfileRequest], now: k8s_openapi::jiff::Timestamp) -> String {
    let triggered = requests
        .iter()
        .any(|r| r.status.as_ref().is_some_and(|s| s.trigger.is_some()));
    let mut rows = vec![vec![
        "NAME".to_string(),
        "TYPE".into(),
        "PHASE".into(),
        "PODS".into(),
        "NODES".into(),
        "AGE".into(),
    ]];
    if triggered {
        rows[0].push("TRIGGER".into());
    }
    for r in requests {
        let status = r.status.as_ref();
        let created = r
            .metadata
            .creation_timestamp
            .as_ref()
            .map(|t| age(now.as_second() - t.0.as_second()))
            .unwrap_or_else(|| "<unknown>".into());
        let mut row = vec![
            r.metadata.name.clone().unwrap_or_default(),
            r.spec.profile_type.to_string(),
            status
                .and_then(|s| s.phase)
                .map_or("Pending", |p| p.as_str())
                .to_string(),
            status
                .and_then(|s| s.pod_count)
                .map_or("-".into(), |n| n.to_string()),
            status
                .and_then(|s| s.node_count)
                .map_or("-".into(), |n| n.to_string()),
            created,
        ];
        if triggered {
            row.push(
                status
                    .and_then(|s| s.trigger.as_ref())
                    .map_or_else(|| "-".into(), |t| t.reason.clone()),
            );
        }
        rows.push(row);
    }
    let columns = rows[0].len();
    let widths: Vec<usize> = (0..columns)
        .map(|c| rows.iter().map(|r| r[c].len()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for r in rows {
        let line: Vec<String> = r
            .iter()
            .zip(&widths)
            .map(|(cell, w)| format!("{cell:<w$}"))
            .collect();
        out.push_str(line.join("   ").trim_end());
        out.push('\n');
    }
    out
}

/// Prints the namespace's requests.
pub async fn list(cluster: &Cluster, out: &mut dyn Write) -> Result<()> {
    let items = requests::list(cluster).await?;
    if items.is_empty() {
        let _ = writeln!(
            out,
            "No profilerequests found in {} namespace.",
            cluster.namespace
        );
        return Ok(());
    }
    let _ = write!(
        out,
        "{}",
        table(&items, k8s_openapi::jiff::Timestamp::now())
    );
    Ok(())
}

/// Deletes one request.
pub async fn delete(cluster: &Cluster, name: &str, out: &mut dyn Write) -> Result<()> {
    requests::delete(cluster, name).await?;
    let _ = writeln!(out, "profilerequest.flamefleet.dev \"{name}\" deleted");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ages_like_kubectl() {
        assert_eq!(age(5), "5s");
        assert_eq!(age(600), "10m");
        assert_eq!(age(3 * 3600), "3h");
        assert_eq!(age(5 * 86_400), "5d");
    }

    #[test]
    fn a_trigger_column_appears_only_with_triggered_runs() {
        let now = k8s_openapi::jiff::Timestamp::from_second(1_767_607_300).unwrap();
        let plain: ProfileRequest = serde_json::from_value(serde_json::json!({
            "apiVersion": "flamefleet.dev/v1alpha1", "kind": "ProfileRequest",
            "metadata": {"name": "adhoc", "creationTimestamp": "2026-01-05T10:00:00Z"},
            "spec": {"type": "cpu", "podNames": ["web"], "duration": "10s"},
        }))
        .unwrap();
        let header = |text: &str| text.lines().next().unwrap_or_default().to_string();
        assert!(!header(&table(std::slice::from_ref(&plain), now)).contains("TRIGGER"));
        let mut fired = plain.clone();
        fired.metadata.name = Some("oom-t1767607230-ab12cd34".into());
        fired.status = Some(serde_json::from_value(serde_json::json!({
            "phase": "Succeeded",
            "trigger": {"name": "near-limit", "condition": "memory above 60% of limit",
                        "measured": "61.3", "threshold": "60.0", "pod": "web", "node": "n1",
                        "firedAt": "2026-01-05T10:00:00Z",
                        "reason": "near-limit: memory above 60% of limit (measured 61.3%, threshold 60.0%)"},
        }))
        .unwrap());
        let text = table(&[plain, fired], now);
        assert!(header(&text).ends_with("TRIGGER"), "{text}");
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines[1].trim_end().ends_with('-'), "{text}");
        assert!(
            lines[2].ends_with(
                "near-limit: memory above 60% of limit (measured 61.3%, threshold 60.0%)"
            ),
            "{text}"
        );
    }
}
