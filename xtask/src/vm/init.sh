#!/bin/sh
# PID 1 of a `cargo xtask vm-test` VM (xtask/src/vm/). Sets up what the tests
# expect of a host, loads the kernel modules listed in /etc/vm-test/modules,
# mounts the host directories shared over 9p at their host paths, runs
# $vmtest_out/run.sh (written by xtask) with its output also in
# $vmtest_out/tests.log, checks that the modules in
# /etc/vm-test/probe-modules load, keeps the agents' logs, and powers off.
#
# From the kernel command line (unknown name=value words become init's
# environment): vmtest_ro (comma-separated paths, shared as tags ro0, ro1, ...,
# read-only) and vmtest_out (the writable tag "out").
# The host reads the lines starting with "vm-test: ".

export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8

mount -t devtmpfs dev /dev 2>/dev/null
exec </dev/null >/dev/console 2>&1

finish() {
    echo "vm-test: done rc=$1"
    sync
    echo o >/proc/sysrq-trigger
    sleep 10
    exit 1 # panic=-1 and -no-reboot end QEMU if power-off did not
}
die() {
    echo "vm-test: init: $*"
    finish init-failed
}

mount -t proc proc /proc
mount -t sysfs sys /sys
mkdir -p /dev/pts /dev/shm
mount -t devpts devpts /dev/pts
mount -t tmpfs shm /dev/shm
mount -t tmpfs tmp /tmp
mount -t tmpfs run /run
mount -t cgroup2 cgroup2 /sys/fs/cgroup || die "cannot mount cgroup2"
mount -t bpf bpf /sys/fs/bpf || die "cannot mount bpffs"
mount -t debugfs debugfs /sys/kernel/debug 2>/dev/null
mount -t tracefs tracefs /sys/kernel/tracing 2>/dev/null
hostname vm-test
ip link set lo up

echo "vm-test: init on $(uname -r) after $(cut -d' ' -f1 /proc/uptime)s"
for m in $(cat /etc/vm-test/modules); do
    modprobe "$m" || echo "vm-test: modprobe $m failed"
done
echo "vm-test: modules loaded: $(cut -d' ' -f1 /proc/modules | sort | tr '\n' ' ')"

i=0
for p in $(echo "$vmtest_ro" | tr ',' ' '); do
    mkdir -p "$p"
    mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000,cache=loose,ro "ro$i" "$p" || die "cannot mount $p (9p)"
    i=$((i + 1))
done
[ -n "$vmtest_out" ] || die "no vmtest_out= on the kernel command line"
mkdir -p "$vmtest_out" 2>/dev/null
mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000 out "$vmtest_out" || die "cannot mount $vmtest_out (9p)"

{ sh "$vmtest_out/run.sh"; echo $? >/tmp/vm-test.rc; } 2>&1 | tee "$vmtest_out/tests.log"
rc=$(cat /tmp/vm-test.rc)

mkdir -p "$vmtest_out/agent-logs"
for f in /tmp/*.agent.log; do
    [ -e "$f" ] && cp "$f" "$vmtest_out/agent-logs/"
done
# Loadable, but left out while the tests ran (see PROBED_MODULES in kernel.rs).
for m in $(cat /etc/vm-test/probe-modules); do
    if modprobe "$m" && grep -q "^$m " /proc/modules; then
        echo "vm-test: module $m loads"
    else
        echo "vm-test: module $m does not load"
    fi
done
dmesg >"$vmtest_out/dmesg.log"
finish "$rc"
