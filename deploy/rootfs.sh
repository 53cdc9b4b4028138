#!/bin/sh
# Assembles the runtime image's files under OUT: the given binaries in /usr/local/bin, the
# shared libraries they load (from ldd, with the dynamic loader), the CA certificates the
# HTTPS clients trust, and empty /tmp and state directories. Nothing else: no shell, no
# package manager. Used by the Containerfile's build stage and by the test that builds the
# image from prebuilt binaries (tests/tests/it/deploy.rs).
#
# usage: deploy/rootfs.sh OUT BINARY...
set -eu
out=$1
shift
mkdir -p "$out/usr/local/bin" "$out/etc/ssl/certs" "$out/tmp" "$out/var/lib/grl" "$out/var/lib/rlc"
chmod 1777 "$out/tmp"
for b in "$@"; do
    cp "$b" "$out/usr/local/bin/"
    # `ldd` lines: "libz.so.1 => /lib/x86_64-linux-gnu/libz.so.1 (0x…)" and the loader.
    for lib in $(ldd "$b" | sed -n 's/.*=> \(\/[^ ]*\).*/\1/p; s/^[[:space:]]*\(\/[^ ]*\) (.*/\1/p'); do
        mkdir -p "$out$(dirname "$lib")"
        cp -L "$lib" "$out$lib"
    done
done
if [ -f /etc/ssl/certs/ca-certificates.crt ]; then
    cp -L /etc/ssl/certs/ca-certificates.crt "$out/etc/ssl/certs/"
fi
# The unprivileged user the image runs as (65532), for tools that look it up.
mkdir -p "$out/etc"
printf 'root:x:0:0::/:/nonexistent\nnonroot:x:65532:65532::/var/lib/rlc:/nonexistent\n' > "$out/etc/passwd"
printf 'root:x:0:\nnonroot:x:65532:\n' > "$out/etc/group"
