"""Self cost of a callgrind dump by component, per request.

    python3 grl-runtime/benches/callgrind_groups.py cg.PID.1 REQUESTS [TOP]

REQUESTS is the number of requests the dump covers (the sidecar's `grl_sidecar_requests_total`
before `callgrind_control -z` and after `-d`); TOP also lists the TOP costliest functions.
Each function's own instructions (not its callees') go to the first component whose pattern
matches its name; the components add up to the dump's total. Recipe: docs/grl-sidecar-bench.md.
"""
import re, sys, collections
path, nreq = sys.argv[1], int(sys.argv[2])
names = {}
self_cost = collections.Counter()
cur = None
skip_next = False
def name(tok, table):
    m = re.match(r'\((\d+)\)(?:\s+(.*))?', tok)
    if not m: return tok
    if m.group(2): table[m.group(1)] = m.group(2)
    return table.get(m.group(1), tok)
fns = {}
for line in open(path, errors='replace'):
    line = line.rstrip('\n')
    if line.startswith('fn='):
        cur = name(line[3:], fns); continue
    if line.startswith('cfn=') :
        name(line[4:], fns); continue
    if line.startswith('calls='):
        skip_next = True; continue
    if line and (line[0].isdigit() or line[0] in '+-*'):
        if skip_next:
            skip_next = False; continue
        parts = line.split()
        if len(parts) >= 2 and cur:
            self_cost[cur] += int(parts[1])
total = sum(self_cost.values())
def group(fn):
    rules = [
        ('allocator (mimalloc)', r'^_?mi_|mimalloc|^__rust_(alloc|dealloc|realloc)|alloc::alloc::|RawVec'),
        ('memcpy/memmove/memset (libc)', r'^__mem|^mem(cpy|move|set)'),
        ('HTTP/2 (the h2 crate: frames, HPACK, streams, flow control)', r'^<?h2::|<h2::'),
        ('hyper HTTP/2 glue', r'hyper::proto::h2'),
        ('HTTP/1 parse (httparse)', r'^httparse::'),
        ('hyper HTTP/1 client (upstream side)', r'hyper::proto::h1::role::Client|hyper::client|hyper_util::client'),
        ('hyper HTTP/1 server (caller side)', r'hyper::proto::h1::role::Server|hyper::server'),
        ('hyper HTTP/1 connection, dispatch, buffers, bodies', r'^<?hyper::'),
        ('headers (http::HeaderMap, names, values)', r'^<?http::header|^<?http::'),
        ('the sidecar (routing, identity, decision glue, metrics)', r'grl_sidecar'),
        ('the decision (grl-client, grl-core)', r'grl_client|grl_core'),
        ('tokio (scheduler, I/O readiness, timers, channels)', r'^<?tokio::'),
        ('clock (Instant::now, clock_gettime)', r'Timespec|clock_gettime|Instant|__vdso'),
        ('hashing (SipHash, ahash, foldhash)', r'sip::|Hasher|hash::'),
        ('bytes', r'^<?bytes::'),
        ('syscall wrappers (libc)', r'^(__)?(libc_)?(send|recv|read|write|epoll|writev|sendto|recvfrom)|syscall'),
    ]
    for g, rx in rules:
        if re.search(rx, fn): return g
    return 'other'
groups = collections.Counter()
for fn, c in self_cost.items():
    groups[group(fn)] += c
print(f"total {total:,} = {total/nreq:,.0f} per request")
for g, c in groups.most_common():
    print(f"| {g} | {c/nreq:,.0f} | {100*c/total:.1f} % |")
if len(sys.argv) > 3:
    for fn, c in self_cost.most_common(int(sys.argv[3])):
        print(f"{c/nreq:8.0f}  {group(fn)[:20]:20}  {fn[:150]}")
