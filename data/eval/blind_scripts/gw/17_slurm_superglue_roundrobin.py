"""Multi-task fine-tuning of DeBERTa-v3-large on SuperGLUE classification tasks,
multi-node under Slurm (one process per GPU, started by srun).

Batches are taken round-robin from the task loaders until every loader is
exhausted; each step trains one task's head. Activation checkpointing keeps the
large encoder within memory at sequence length 512.

sbatch script:
    #SBATCH --nodes=2 --ntasks-per-node=8 --gpus-per-node=8 --cpus-per-task=10
    export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
    export MASTER_PORT=29541
    srun python mt_superglue.py --data /shared/datasets/superglue_arrow --out /shared/checkpoints/$SLURM_JOB_ID
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from datasets import load_from_disk
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset
from transformers import AutoModel, AutoTokenizer, DataCollatorWithPadding, get_linear_schedule_with_warmup

TASKS = {"boolq": 2, "cb": 3, "rte": 2, "wic": 2}
TEXT = {"boolq": ("question", "passage"), "cb": ("premise", "hypothesis"),
        "rte": ("premise", "hypothesis"), "wic": ("sentence1", "sentence2")}


def setup():
    rank = int(os.environ["SLURM_PROCID"])
    world = int(os.environ["SLURM_NTASKS"])
    local_rank = int(os.environ["SLURM_LOCALID"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", init_method="env://", rank=rank, world_size=world)
    return rank, world, local_rank


class MTModel(nn.Module):
    def __init__(self, name):
        super().__init__()
        self.encoder = AutoModel.from_pretrained(name)
        self.encoder.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        h = self.encoder.config.hidden_size
        self.heads = nn.ModuleDict({t: nn.Sequential(nn.Dropout(0.1), nn.Linear(h, n)) for t, n in TASKS.items()})

    def forward(self, task, input_ids, attention_mask, token_type_ids=None):
        h = self.encoder(input_ids=input_ids, attention_mask=attention_mask,
                         token_type_ids=token_type_ids).last_hidden_state[:, 0]
        return self.heads[task](h)


def tokenize_all(data_dir, tok, max_len):
    train, val = {}, {}
    for t in TASKS:
        d = load_from_disk(os.path.join(data_dir, t))
        a, b = TEXT[t]
        # map without writing cache files: the arrow dir is on shared read-only storage
        fn = lambda ex, a=a, b=b: tok(ex[a], ex[b], truncation="only_second" if a == "question" else True,
                                      max_length=max_len)
        d = d.map(fn, batched=True, load_from_cache_file=False, keep_in_memory=True,
                  remove_columns=[c for c in d["train"].column_names if c != "label"])
        train[t], val[t] = d["train"], d["validation"]
    return train, val


@torch.no_grad()
def evaluate(net, val, collate, device, rank, world):
    net.eval()
    c = torch.zeros(len(TASKS), 2, device=device)
    for i, (t, ds) in enumerate(val.items()):
        loader = DataLoader(Subset(ds, range(rank, len(ds), world)), batch_size=32, collate_fn=collate)
        for b in loader:
            b = {k: v.to(device) for k, v in b.items()}
            labels = b.pop("labels")
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pred = net(t, **b).argmax(-1)
            c[i, 0] += (pred == labels).sum()
            c[i, 1] += labels.numel()
    dist.all_reduce(c)
    net.train()
    return {t: (c[i, 0] / c[i, 1]).item() for i, t in enumerate(TASKS)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True, help="on storage shared by all nodes")
    ap.add_argument("--model", default="microsoft/deberta-v3-large")
    ap.add_argument("--max_len", type=int, default=512)
    ap.add_argument("--batch_size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=8e-6)
    ap.add_argument("--epochs", type=int, default=10)
    args = ap.parse_args()

    rank, world, local_rank = setup()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1)

    tok = AutoTokenizer.from_pretrained(args.model)
    collate = DataCollatorWithPadding(tok, pad_to_multiple_of=8)
    train, val = tokenize_all(args.data, tok, args.max_len)

    samplers = {t: DistributedSampler(ds, shuffle=True, seed=1) for t, ds in train.items()}
    loaders = {t: DataLoader(ds, batch_size=args.batch_size, sampler=samplers[t], collate_fn=collate,
                             num_workers=4, pin_memory=True) for t, ds in train.items()}
    # DistributedSampler pads every task to the same per-rank length, so the
    # round-robin below runs the same number of steps in the same order on every rank
    steps_per_epoch = sum(len(l) for l in loaders.values())

    net = MTModel(args.model).to(device)
    model = DDP(net, device_ids=[local_rank], find_unused_parameters=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = steps_per_epoch * args.epochs
    sched = get_linear_schedule_with_warmup(opt, int(0.1 * total), total)

    ckpt = os.path.join(args.out, "last.pt")
    start = 0
    if os.path.exists(ckpt):
        state = torch.load(ckpt, map_location="cpu")
        net.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        start = state["epoch"] + 1
        if rank == 0:
            print(f"resuming at epoch {start}", flush=True)

    for epoch in range(start, args.epochs):
        for s in samplers.values():
            s.set_epoch(epoch)
        active = {t: iter(l) for t, l in loaders.items()}
        model.train()
        t0, step = time.time(), 0
        while active:
            for t in list(active):
                try:
                    b = next(active[t])
                except StopIteration:
                    del active[t]
                    continue
                b = {k: v.to(device, non_blocking=True) for k, v in b.items()}
                labels = b.pop("labels")
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = model(t, **b)
                loss = F.cross_entropy(logits.float(), labels)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                step += 1
                if step % 100 == 0:
                    l = loss.detach().clone()
                    dist.all_reduce(l, op=dist.ReduceOp.AVG)
                    if rank == 0:
                        print(f"ep {epoch} step {step}/{steps_per_epoch} [{t}] loss {l.item():.4f} "
                              f"({time.time() - t0:.0f}s)", flush=True)

        acc = evaluate(net, val, collate, device, rank, world)
        if rank == 0:
            print(f"epoch {epoch} val {acc} avg {sum(acc.values()) / len(acc):.4f}", flush=True)
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch, "val": acc}, ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
