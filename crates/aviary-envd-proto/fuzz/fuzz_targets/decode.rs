//! Feeds arbitrary bytes to everything envd parses from an untrusted peer: the
//! frame decoder, the JSON messages, and sandbox path normalisation.
#![no_main]

use aviary_envd_proto::{
    decode_json, join_components, normalize_path, read_frame, ErrorBody, Request, Response,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut r = data;
    while let Ok(Some(frame)) = read_frame(&mut r) {
        assert!(frame.payload.len() <= frame.kind.max_len() as usize);
        if let Ok(req) = decode_json::<Request>(&frame.payload) {
            // Whatever decodes and re-encodes within the limit decodes to the same request.
            if let Ok(bytes) = aviary_envd_proto::encode_json(&req) {
                assert_eq!(decode_json::<Request>(&bytes).unwrap(), req);
            }
        }
        let _ = decode_json::<Response>(&frame.payload);
        let _ = decode_json::<ErrorBody>(&frame.payload);
    }
    if let Ok(s) = std::str::from_utf8(data) {
        if let Ok(comps) = normalize_path(s) {
            assert!(comps.iter().all(|c| !c.is_empty() && c != "." && c != ".."));
            assert_eq!(normalize_path(&join_components(&comps)).unwrap(), comps);
        }
    }
});
