#!/usr/bin/env python3
"""Build a single-layer OCI image archive (oci-layout tar) from a directory, for ``ctr images import``.

usage: mkimage.py ROOTFS_DIR IMAGE_NAME OUT.tar [ENTRYPOINT...]

The test cluster has no registry: up.sh builds its pause (sandbox) image and a tiny base image
(busybox + an usr-merged skeleton whose /usr, /etc ... the pods bind from the host) with this.
Deterministic: owners 0:0, mtime 0, sorted entries (same directory -> same digest).
"""

import hashlib
import io
import json
import os
import sys
import tarfile


def sha(b: bytes) -> str:
    return "sha256:" + hashlib.sha256(b).hexdigest()


def layer_of(rootfs: str) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
        for dp, dns, fns in os.walk(rootfs):
            dns.sort()
            for n in sorted(dns) + sorted(fns):
                p = os.path.join(dp, n)
                ti = t.gettarinfo(p, os.path.relpath(p, rootfs))
                ti.uid = ti.gid = 0
                ti.uname = ti.gname = ""
                ti.mtime = 0
                if ti.isfile():
                    with open(p, "rb") as f:
                        t.addfile(ti, f)
                else:
                    t.addfile(ti)
    return buf.getvalue()


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    rootfs, name, out, entry = argv[0], argv[1], argv[2], argv[3:]
    layer = layer_of(rootfs)
    cfg = json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "created": "1970-01-01T00:00:00Z",
            "config": {
                "Entrypoint": entry or None,
                "WorkingDir": "/",
                "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
            },
            "rootfs": {"type": "layers", "diff_ids": [sha(layer)]},
            "history": [{"created_by": "phalanx tests/infra/k8s/mkimage.py"}],
        }
    ).encode()
    man = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": sha(cfg), "size": len(cfg)},
            "layers": [
                {"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": sha(layer), "size": len(layer)}
            ],
        }
    ).encode()
    idx = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.index.v1+json",
            "manifests": [
                {
                    "mediaType": "application/vnd.oci.image.manifest.v1+json",
                    "digest": sha(man),
                    "size": len(man),
                    "platform": {"architecture": "amd64", "os": "linux"},
                    "annotations": {
                        "io.containerd.image.name": name,
                        "org.opencontainers.image.ref.name": name.rsplit(":", 1)[1],
                    },
                }
            ],
        }
    ).encode()
    tmp = out + ".tmp"
    with tarfile.open(tmp, "w") as t:

        def add(n: str, b: bytes) -> None:
            ti = tarfile.TarInfo(n)
            ti.size = len(b)
            ti.mtime = 0
            t.addfile(ti, io.BytesIO(b))

        add("oci-layout", b'{"imageLayoutVersion":"1.0.0"}')
        add("index.json", idx)
        for b in (layer, cfg, man):
            add("blobs/sha256/" + sha(b)[7:], b)
    os.replace(tmp, out)
    print(name, sha(man))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
