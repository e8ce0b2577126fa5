//! Admission policies that are part of the Flamefleet API (`crds/policies/*.yaml`), for the
//! chart and the tests to install next to the CRDs.

/// Every policy document, as YAML text (each file may hold several documents).
pub const POLICIES: &[(&str, &str)] = &[
    (
        "profile-download-access.yaml",
        include_str!("../policies/profile-download-access.yaml"),
    ),
    (
        "namespace-limits.yaml",
        include_str!("../policies/namespace-limits.yaml"),
    ),
];

/// Every policy object, parsed.
///
/// # Errors
/// [`crate::Error::Policy`] if a committed file does not parse (a test guards against it).
pub fn policy_objects() -> crate::Result<Vec<serde_json::Value>> {
    let mut out = Vec::new();
    for (name, text) in POLICIES {
        for doc in serde_yaml::Deserializer::from_str(text) {
            let value =
                serde_json::Value::deserialize(doc).map_err(|source| crate::Error::Policy {
                    file: (*name).to_owned(),
                    source,
                })?;
            if !value.is_null() {
                out.push(value);
            }
        }
    }
    Ok(out)
}

use serde::Deserialize as _;

#[cfg(test)]
mod tests {
    #[test]
    fn policies_parse_into_policies_and_their_bindings() {
        let objects = super::policy_objects().expect("policies parse");
        let kinds: Vec<_> = objects
            .iter()
            .map(|o| o["kind"].as_str().unwrap_or_default().to_owned())
            .collect();
        assert_eq!(
            kinds,
            [
                "ValidatingAdmissionPolicy",
                "ValidatingAdmissionPolicyBinding",
                "ValidatingAdmissionPolicy",
                "ValidatingAdmissionPolicyBinding"
            ]
        );
    }
}
