//! Service translation for processes on the node itself (kubelet, host-
//! network pods): their packets reach no interface's ingress before routing,
//! so the destination is translated at the socket instead, by cgroup hooks
//! on `--cgroup-root`. connect() (TCP, connected UDP) and sendmsg()
//! (unconnected UDP) get the backend; getpeername() and recvmsg() give the
//! frontend back, so the application only ever sees the address it dialled.
//! No NAT happens: the socket talks to the backend directly, from a node
//! address, which is what kube-proxy's masquerade would have made of it.
//! The IPv6 hooks (connect6, ...) read and write `user_ip6`; an IPv4-mapped
//! address dialled on an IPv6 socket is the IPv4 frontend, as in the maps.
//!
//! Only sockets in the node's own network namespace are translated here
//! (Cilium's socketLB.hostNamespaceOnly). On a real node `--cgroup-root`
//! sits above every pod's cgroup too, but a pod's connection must get what
//! TC gives it at the pod's veth: masquerade towards NodePorts and LB IPs,
//! source ranges checked against the pod's address, affinity per pod, and
//! its own `127.0.0.1` left alone. So a socket in any other namespace is
//! left to TC (see docs/semantics.md, "Which hook translates a flow").

use aya_ebpf::{
    EbpfContext, Global,
    bindings::BPF_ANY,
    helpers::{bpf_get_netns_cookie, bpf_get_socket_cookie, bpf_set_retval},
    programs::SockAddrContext,
};
use proxy_common::{
    Addr, CtKey, FrontendKey, HOST_NETNS_COOKIE, HOST_NETNS_PROBE, SCOPE_INTERNAL, SVC_DROP_IF_EMPTY, ServiceEntry,
    SockRevKey,
};

use crate::{
    lb::{self, Miss},
    maps::{HOST_NETNS, SOCK_REVNAT},
};

/// The hook's verdicts: 1 lets the call proceed, 0 fails it (with the errno
/// set through bpf_set_retval, EPERM otherwise).
const PROCEED: i32 = 1;
const FAIL: i32 = 0;
const ECONNREFUSED: i32 = 111;

/// Set by the agent at load: 1 where the kernel has bpf_set_retval for these
/// hooks (Linux 5.18+). Elsewhere a refused connect() fails with EPERM, the
/// only errno a hook can give there; the verifier drops the dead call.
#[unsafe(no_mangle)]
static HAS_SET_RETVAL: Global<u32> = Global::new(1);

/// Which address field of the context a hook uses.
#[derive(Clone, Copy)]
pub enum Family {
    V4,
    V6,
}

#[inline(always)]
fn sock(ctx: &SockAddrContext) -> &mut aya_ebpf::bindings::bpf_sock_addr {
    unsafe { &mut *ctx.sock_addr }
}

/// The address the caller passed (connect, sendmsg) or is shown (recvmsg,
/// getpeername). `user_ip6` is read one 32-bit word at a time, the only
/// access the verifier allows; each word is in network order.
#[inline(always)]
fn user_addr(s: &aya_ebpf::bindings::bpf_sock_addr, family: Family) -> Addr {
    match family {
        Family::V4 => Addr::from_v4_octets(s.user_ip4.to_ne_bytes()),
        Family::V6 => {
            let mut a = [0u8; 16];
            for (i, word) in s.user_ip6.iter().enumerate() {
                a[i * 4..i * 4 + 4].copy_from_slice(&word.to_ne_bytes());
            }
            Addr(a)
        }
    }
}

/// The port field (network order in its low 16 bits), read whole: kernels
/// before 5.17 refuse a narrower load of `user_port`, which `as u16` on a
/// plain field read lets the compiler emit.
#[inline(always)]
fn user_port(s: &aya_ebpf::bindings::bpf_sock_addr) -> u16 {
    unsafe { core::ptr::read_volatile(&s.user_port) as u16 }
}

/// `protocol`, read whole for the same reason.
#[inline(always)]
fn protocol(s: &aya_ebpf::bindings::bpf_sock_addr) -> u8 {
    unsafe { core::ptr::read_volatile(&s.protocol) as u8 }
}

#[inline(always)]
fn set_user_addr(s: &mut aya_ebpf::bindings::bpf_sock_addr, family: Family, addr: &Addr) {
    match family {
        Family::V4 => s.user_ip4 = u32::from_ne_bytes(addr.v4_octets()),
        Family::V6 => {
            for i in 0..4 {
                s.user_ip6[i] = u32::from_ne_bytes([addr.0[i * 4], addr.0[i * 4 + 1], addr.0[i * 4 + 2], addr.0[i * 4 + 3]]);
            }
        }
    }
}

/// Whether the socket lives in the node's network namespace, the one the
/// agent runs in. Until the agent has stored that namespace's cookie no
/// socket is (the agent stores it before it attaches the hooks).
#[inline(always)]
fn in_node_netns(ctx: &SockAddrContext) -> bool {
    let Some(&node) = HOST_NETNS.get(HOST_NETNS_COOKIE) else { return false };
    node != 0 && unsafe { bpf_get_netns_cookie(ctx.as_ptr()) } == node
}

/// On kernels without SO_NETNS_COOKIE the agent learns its namespace's
/// cookie by connecting a probe socket whose cookie it stored first: only
/// that socket can set it.
#[inline(always)]
pub fn learn_node_netns(ctx: &SockAddrContext) {
    let Some(&probe) = HOST_NETNS.get(HOST_NETNS_PROBE) else { return };
    if probe != 0 && cookie(ctx) == probe {
        let netns = unsafe { bpf_get_netns_cookie(ctx.as_ptr()) };
        if let Some(slot) = HOST_NETNS.get_ptr_mut(HOST_NETNS_COOKIE) {
            unsafe { *slot = netns };
        }
    }
}

/// connect / sendmsg: a frontend's address becomes a backend's.
#[inline(always)]
pub fn translate(ctx: &SockAddrContext, family: Family) -> i32 {
    if !in_node_netns(ctx) {
        return PROCEED;
    }
    let s = sock(ctx);
    let proto = protocol(s);
    let addr = user_addr(s, family);
    let port = user_port(s);
    let tuple = CtKey { src: Addr::default(), dst: addr, sport: 0, dport: port, proto, _pad: [0; 3] };
    // The node counts as in-cluster: for externalTrafficPolicy=Local frontends
    // it reaches every endpoint, as kube-proxy sends local traffic.
    let service = match lb::lookup_frontend(&tuple, SCOPE_INTERNAL) {
        Ok(service) => service,
        Err(Miss::NotOurs) => return PROCEED,
        Err(Miss::Reject) => return refuse(),
        Err(Miss::DropUnallocated) => return FAIL,
    };
    let cookie = cookie(ctx);
    let Some(lb::Choice { backend, .. }) = lb::choose_backend(&service, &flow(cookie, &service, &tuple), true) else {
        return if service.flags & SVC_DROP_IF_EMPTY != 0 { FAIL } else { refuse() };
    };
    let key = SockRevKey { cookie, addr: backend.addr, port: backend.port, proto, _pad: [0; 5] };
    let frontend = FrontendKey { addr, port, proto, scope: SCOPE_INTERNAL };
    let _ = SOCK_REVNAT.insert(&key, &frontend, BPF_ANY as u64);
    set_user_addr(s, family, &backend.addr);
    s.user_port = backend.port as u32;
    PROCEED
}

/// The flow `lb::choose_backend` sees for a node socket. Before bind() a
/// socket has no source address or port, so none is hashed: with ClientIP
/// affinity the node is one client (the unspecified address, as its
/// AFFINITY key), and Maglev hashes the frontend alone, so every node
/// connection without a fresh entry gets the same cell; without affinity
/// the socket's `cookie` stands for the source, so sockets spread over the
/// table as they would at random, and an unconnected UDP socket's datagrams
/// (a sendmsg each) all go to one backend.
#[inline(always)]
fn flow(cookie: u64, service: &ServiceEntry, tuple: &CtKey) -> CtKey {
    let mut flow = *tuple;
    if service.affinity_timeout_s == 0 {
        let mut src = [0u8; 16];
        src[8..].copy_from_slice(&cookie.to_be_bytes());
        flow.src = Addr(src);
    }
    flow
}

/// getpeername / recvmsg: a backend's address is shown as the frontend's.
#[inline(always)]
pub fn reverse(ctx: &SockAddrContext, family: Family) -> i32 {
    let s = sock(ctx);
    let key = SockRevKey {
        cookie: cookie(ctx),
        addr: user_addr(s, family),
        port: user_port(s),
        proto: protocol(s),
        _pad: [0; 5],
    };
    if let Some(frontend) = unsafe { SOCK_REVNAT.get(&key) } {
        set_user_addr(s, family, &frontend.addr);
        s.user_port = frontend.port as u32;
    }
    PROCEED
}

#[inline(always)]
fn cookie(ctx: &SockAddrContext) -> u64 {
    unsafe { bpf_get_socket_cookie(ctx.as_ptr()) }
}

/// kube-proxy's REJECT as the caller sees it: ECONNREFUSED.
#[inline(always)]
fn refuse() -> i32 {
    if HAS_SET_RETVAL.load() != 0 {
        unsafe { bpf_set_retval(-ECONNREFUSED) };
    }
    FAIL
}
