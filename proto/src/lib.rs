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
            "QuitQuitQuit",
            "HotRestart",
            "UpdateConfig",
        ] {
            assert!(methods.contains(&rpc), "{rpc} in {methods:?}");
        }
    }
}
