"""Reading compiled HLO text in tests: the replica groups of a collective."""

import re

import numpy as np

# A collective's replica_groups in any of the forms XLA prints them.
GROUPS = r"\{[{}0-9,]*\}|\[[0-9,]+\]<=\[[0-9,]+\](?:T\([0-9,]+\))?|mesh\[[^\]]*\] \{[^}]*\}"
IOTA = re.compile(r"\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?")
MESH = re.compile(r"mesh\[([^\]]*)\] \{([^}]*)\}")


def replica_groups(text: str) -> list[list[int]]:
    """HLO replica groups (`GROUPS`): explicit ({{0,2},{1,3}}), iota ([2,2]<=[4], [2,2]<=[2,2]T(1,0))
    or over named mesh axes (mesh['axis_0'=2,'axis_1'=2] {'axis_0'}: devices varying along those)."""
    if text.startswith("{"):
        return [[int(i) for i in g.split(",") if i] for g in re.findall(r"\{([0-9,]*)\}", text)]
    if m := MESH.fullmatch(text):
        axes = [(a.split("=")[0].strip("'"), int(a.split("=")[1])) for a in m[1].split(",")]
        chosen = [i for i, (name, _) in enumerate(axes) if f"'{name}'" in m[2]]
        rest = [i for i in range(len(axes)) if i not in chosen]
        ids = np.arange(np.prod([n for _, n in axes])).reshape([n for _, n in axes])
        size = int(np.prod([axes[i][1] for i in chosen]))
        return ids.transpose(rest + chosen).reshape(-1, size).tolist()
    m = IOTA.fullmatch(text)
    assert m, f"unparsed replica groups {text}"
    shape, dims = [int(i) for i in m[1].split(",")], [int(i) for i in m[2].split(",")]
    ids = np.arange(np.prod(dims)).reshape(dims)
    if m[3]:
        ids = ids.transpose([int(i) for i in m[3].split(",")])
    return ids.reshape(shape).tolist()
