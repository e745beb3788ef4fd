//! Fuzz target: `decode` must never panic, and its errors must point inside
//! the input (or just past its end, for truncation).

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    match outbox_pgoutput::decode(bytes::Bytes::copy_from_slice(data)) {
        Ok(message) => {
            // Exercise the derived impls on whatever was decoded.
            let _ = format!("{message:?}");
            assert_eq!(message.clone(), message);
        }
        Err(e) => {
            assert!(e.offset() <= data.len(), "{e} for {} bytes", data.len());
            let _ = e.to_string();
        }
    }
});
