//! The `envoyagent.v1` gRPC API (`envoyagent/v1/agent.proto`): generated types, client and
//! server, and the encoded descriptor set for server reflection.
//!
//! The code is generated at build time from the `.proto` by protox and tonic-prost-build, so a
//! fresh machine needs no `protoc`.

/// Generated code of `envoyagent.v1`.
pub mod pb {
    #![allow(missing_docs, unreachable_pub, clippy::all, clippy::unwrap_used)]
    tonic::include_proto!("envoyagent.v1");
}

/// The encoded `FileDescriptorSet` of the API, for gRPC server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/envoyagent_descriptor.bin"));

#[cfg(test)]
mod tests {
    use prost::Message;

    #[test]
    fn the_descriptor_set_decodes_and_names_the_service() {
        let fds = prost_types::FileDescriptorSet::decode(super::FILE_DESCRIPTOR_SET).unwrap();
        let file = fds
            .file
            .iter()
            .find(|f| f.package() == "envoyagent.v1")
            .expect("the envoyagent.v1 file");
        let service = &file.service[0];
        assert_eq!(service.name(), "AgentService");
        let methods: Vec<&str> = service.method.iter().map(|m| m.name()).collect();
        for rpc in [
            "GetStatus",
            "WatchStatus",
            "Drain",
            "DrainNow",
            "DisableDraining",
            "Stop",
            "QuitQuitQuit",
            "ReopenLogs",
            "HotRestart",
            "UpdateConfig",
        ] {
            assert!(methods.contains(&rpc), "{rpc} in {methods:?}");
        }
    }

    /// buf's STANDARD rules (ENUM_ZERO_VALUE_SUFFIX, ENUM_VALUE_PREFIX), checked here too so
    /// that `cargo test` catches a new enum without its UNSPECIFIED zero even where buf is not
    /// installed: a controller must tell "not set" from every real value.
    #[test]
    fn every_enum_has_its_unspecified_zero_and_prefixed_values() {
        let fds = prost_types::FileDescriptorSet::decode(super::FILE_DESCRIPTOR_SET).unwrap();
        let file = fds
            .file
            .iter()
            .find(|f| f.package() == "envoyagent.v1")
            .expect("the envoyagent.v1 file");
        let mut enums: Vec<&prost_types::EnumDescriptorProto> = file.enum_type.iter().collect();
        let mut messages: Vec<&prost_types::DescriptorProto> = file.message_type.iter().collect();
        while let Some(m) = messages.pop() {
            enums.extend(&m.enum_type);
            messages.extend(&m.nested_type);
        }
        assert!(enums.len() >= 9, "the API's enums: {}", enums.len());
        for e in enums {
            let prefix = screaming_snake(e.name());
            let zero = e
                .value
                .iter()
                .find(|v| v.number() == 0)
                .unwrap_or_else(|| panic!("{} has no zero value", e.name()));
            assert_eq!(zero.name(), format!("{prefix}_UNSPECIFIED"), "{}", e.name());
            assert_eq!(
                e.value[0].number(),
                0,
                "{}: the zero value comes first",
                e.name()
            );
            for v in &e.value {
                assert!(
                    v.name().starts_with(&format!("{prefix}_")),
                    "{}: {} lacks the {prefix}_ prefix",
                    e.name(),
                    v.name()
                );
            }
        }
    }

    /// `AgentState` → `AGENT_STATE`.
    fn screaming_snake(name: &str) -> String {
        let mut out = String::new();
        for (i, c) in name.chars().enumerate() {
            if c.is_ascii_uppercase() && i > 0 {
                out.push('_');
            }
            out.push(c.to_ascii_uppercase());
        }
        out
    }

    #[test]
    fn times_are_well_known_types() {
        let fds = prost_types::FileDescriptorSet::decode(super::FILE_DESCRIPTOR_SET).unwrap();
        let file = fds
            .file
            .iter()
            .find(|f| f.package() == "envoyagent.v1")
            .expect("the envoyagent.v1 file");
        assert!(
            file.dependency
                .iter()
                .any(|d| d == "google/protobuf/timestamp.proto"),
            "{:?}",
            file.dependency
        );
        // The imports travel with the set, so that reflection clients can resolve them.
        assert!(
            fds.file
                .iter()
                .any(|f| f.name() == "google/protobuf/duration.proto")
        );
        // A status time is a Timestamp in the generated code.
        let status = super::pb::Status {
            state_since: Some(prost_types::Timestamp {
                seconds: 1,
                nanos: 0,
            }),
            ..Default::default()
        };
        assert_eq!(status.state_since.map(|t| t.seconds), Some(1));
    }
}
