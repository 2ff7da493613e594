"""A writer that commits forever (until killed): version v holds the value v in every tensor.

Run as `python crash_writer.py STORE`; prints "ready" once imported and "committed V" after each
commit returns, so the test knows which versions were promised durable.
"""

import sys

import torch

from storage.errors import BadInputError
from storage.store import ExpertTensor, Store

EXPERTS = 6


def main(root: str) -> None:
    try:
        store = Store.create(root)
    except BadInputError:
        store = Store.open(root)
    print("ready", flush=True)
    while True:
        v = store.version + 1
        with store.writer() as w:
            w.put_dense("embed", torch.full((64, 32), float(v)))
            w.put_file("version.txt", str(v).encode())
            for e in range(EXPERTS):
                w.put_expert(0, e, [ExpertTensor(name=f"e{e}.w1", tensor=torch.full((48, 32), float(v))),
                                    ExpertTensor(name=f"e{e}.w2", tensor=torch.full((32, 48), float(v)).bfloat16())],
                             num_experts=EXPERTS)
            w.commit()
        print(f"committed {v}", flush=True)
        if v % 3 == 0:
            store.gc(keep=1)


if __name__ == "__main__":
    main(sys.argv[1])
