//! A Go-like heap profile for the pprof kit's tests and benchmarks.

use flamefleet_pprof::pb::Profile;
use flamefleet_pprof::{Frame, FrameLine, Label, MappingInfo, ProfileBuilder};

/// A heap profile like a busy Go service's: `samples` stacks of 30 frames over 5,000
/// functions in one mapping, with a numeric label; `seed` varies the stacks.
pub fn heap_profile(samples: usize, seed: u64) -> Profile {
    let mut b = ProfileBuilder::new(&[
        ("alloc_objects", "count"),
        ("alloc_space", "bytes"),
        ("inuse_objects", "count"),
        ("inuse_space", "bytes"),
    ]);
    b.period("space", "bytes", 524_288).comment("go heap");
    let mapping = b.add_mapping(&MappingInfo {
        start: 0x40_0000,
        limit: 0x80_0000,
        file_offset: 0,
        file: "/app/server".into(),
        build_id: "0123456789abcdef".into(),
        has_functions: true,
    });
    let mut x = seed | 1;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    for _ in 0..samples {
        let stack: Vec<Frame> = (0..30)
            .map(|_| {
                let f = next() % 5_000;
                Frame {
                    address: 0x40_0000 + f * 64,
                    mapping: Some(mapping),
                    lines: vec![FrameLine {
                        function: format!("github.com/example/service/pkg{}.Function{f}", f % 50),
                        file: format!("/src/pkg{}/file.go", f % 50),
                        line: (f % 400) as i64,
                    }],
                }
            })
            .collect();
        let v = (next() % 1000) as i64;
        b.add_sample(
            &stack,
            &[v, v * 512, v / 2, v * 256],
            &[Label::Num("bytes".into(), 512, String::new())],
        );
    }
    b.build()
}
