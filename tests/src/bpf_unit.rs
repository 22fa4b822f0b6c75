//! The BPF unit tests' harness (tests/tests/bpf_unit.rs): the unit object
//! (proxy-ebpf's `bpf_unit`, built by tests/build.rs; see
//! proxy-ebpf/src/bpf_unit.rs), loaded with its maps pinned on a private
//! bpffs, and single runs of one program on one frame through
//! BPF_PROG_TEST_RUN.

use anyhow::{Context, Result, ensure};
use aya::{
    Ebpf, EbpfLoader, Pod,
    maps::{Array, HashMap, LpmTrie, MapData},
    programs::{SchedClassifier, TestRun, TestRunOptions, Xdp, XdpMode},
};
use proxy_common::{
    DEFAULT_MAGLEV_TABLE_SIZE, GLOBAL_HAS_COARSE_CLOCK, GLOBAL_MAGLEV_SEED, GLOBAL_MAGLEV_TABLE_SIZE, MAP_AFFINITY, MAP_CONNTRACK, MAP_CT_UNCONFIRMED, MAP_SNAT, MAP_SNAT_UNCONFIRMED,
    MAP_SOCK_REVNAT,
    unit::{UnitReport, UnitSetup},
};

use crate::{bpffs::Bpffs, is_root};

pub static UNIT_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/bpf_unit"));

const UNIT_SETUP: &str = "UNIT_SETUP";
const UNIT_REPORT: &str = "UNIT_REPORT";
/// The preallocated (LRU) maps, kept small: a test holds a few entries.
const SMALL_MAPS: &[&str] = &[
    MAP_CONNTRACK,
    MAP_CT_UNCONFIRMED,
    MAP_SNAT,
    MAP_SNAT_UNCONFIRMED,
    MAP_AFFINITY,
    MAP_SOCK_REVNAT,
    "FRAGMENTS",
    "REJECT_BUDGETS",
];

/// What one run gave: the program's verdict, the frame as it left it, and
/// its report.
pub struct Run {
    pub verdict: u32,
    pub frame: Vec<u8>,
    pub report: UnitReport,
}

pub struct Unit {
    // Fields drop in order: programs and maps go before the bpffs unmounts.
    ebpf: Ebpf,
    _bpffs: Bpffs,
}

impl Unit {
    /// The unit object, loaded afresh (empty maps) for one test.
    pub fn load(label: &str) -> Result<Unit> {
        Self::load_with_maglev(label, 0, DEFAULT_MAGLEV_TABLE_SIZE)
    }

    /// `load`, with Maglev's seed and table size as the agent sets them.
    pub fn load_with_maglev(label: &str, seed: u32, table_size: u32) -> Result<Unit> {
        ensure!(is_root(), "needs root (BPF)");
        let bpffs = Bpffs::new(label).context("mounting a private bpffs")?;
        let features = proxy_user::kernel::probe()?;
        let coarse_clock = u32::from(features.coarse_clock);
        let mut loader = EbpfLoader::new();
        for name in SMALL_MAPS {
            loader.map_max_entries(name, 1024);
        }
        let ebpf = loader
            .default_map_pin_directory(bpffs.path())
            .override_global(GLOBAL_HAS_COARSE_CLOCK, &coarse_clock, true)
            .override_global(GLOBAL_MAGLEV_SEED, &seed, true)
            .override_global(GLOBAL_MAGLEV_TABLE_SIZE, &table_size, true)
            .load(UNIT_OBJECT)
            .context("loading the unit object")?;
        Ok(Unit { ebpf, _bpffs: bpffs })
    }

    /// The setup the next runs read.
    pub fn setup(&mut self, setup: UnitSetup) -> Result<()> {
        let mut map: Array<&mut MapData, UnitSetup> = self.map(UNIT_SETUP)?;
        Ok(map.set(0, &setup, 0)?)
    }

    /// One run of `program` on `frame`, its report zeroed first. The
    /// program goes through the verifier at its first run: a test loads
    /// only the programs it runs, so one that the verifier refuses fails
    /// its own concern's tests, not every test.
    pub fn run(&mut self, program: &str, frame: &[u8]) -> Result<Run> {
        let mut report: Array<&mut MapData, UnitReport> = self.map(UNIT_REPORT)?;
        report.set(0, &UnitReport::default(), 0)?;
        let prog: &mut SchedClassifier =
            self.ebpf.program_mut(program).with_context(|| format!("no program {program}"))?.try_into()?;
        if prog.fd().is_err() {
            prog.load().with_context(|| format!("the verifier refuses {program}"))?;
        }
        let mut out = vec![0u8; frame.len() + 256];
        let res = prog
            .test_run(TestRunOptions { data_in: Some(frame), data_out: Some(&mut out), ..TestRunOptions::new() })
            .with_context(|| format!("BPF_PROG_TEST_RUN of {program}"))?;
        out.truncate(res.data_size_out as usize);
        let report: Array<&mut MapData, UnitReport> = self.map(UNIT_REPORT)?;
        Ok(Run { verdict: res.return_value, frame: out, report: report.get(&0, 0)? })
    }

    /// `xdp_pass` in native mode on each interface (by name, in the calling
    /// thread's network namespace), for as long as this `Unit` lives.
    pub fn attach_xdp_pass(&mut self, interfaces: &[String]) -> Result<()> {
        self.attach_xdp("xdp_pass", interfaces)
    }

    /// The XDP `program` in native mode on each interface, as `attach_xdp_pass`.
    pub fn attach_xdp(&mut self, program: &str, interfaces: &[String]) -> Result<()> {
        let prog: &mut Xdp = self.ebpf.program_mut(program).with_context(|| format!("no program {program}"))?.try_into()?;
        if prog.fd().is_err() {
            prog.load().with_context(|| format!("the verifier refuses {program}"))?;
        }
        for name in interfaces {
            let ifindex = nix::net::if_::if_nametoindex(name.as_str()).with_context(|| format!("no interface {name}"))?;
            prog.attach(ifindex, XdpMode::Driver).with_context(|| format!("native XDP {program} on {name}"))?;
        }
        Ok(())
    }

    /// The loaded object, for programs and maps no helper here covers.
    pub fn ebpf(&self) -> &Ebpf {
        &self.ebpf
    }

    pub fn ebpf_mut(&mut self) -> &mut Ebpf {
        &mut self.ebpf
    }

    /// A hash map of the object (LRU or not) by name.
    pub fn hash<K: Pod, V: Pod>(&mut self, name: &str) -> Result<HashMap<&mut MapData, K, V>> {
        self.map(name)
    }

    pub fn lpm<K: Pod, V: Pod>(&mut self, name: &str) -> Result<LpmTrie<&mut MapData, K, V>> {
        self.map(name)
    }

    fn map<'a, M>(&'a mut self, name: &str) -> Result<M>
    where
        M: TryFrom<&'a mut aya::maps::Map, Error = aya::maps::MapError>,
    {
        let map = self.ebpf.map_mut(name).with_context(|| format!("no map {name} in the unit object"))?;
        M::try_from(map).with_context(|| format!("map {name}"))
    }
}
