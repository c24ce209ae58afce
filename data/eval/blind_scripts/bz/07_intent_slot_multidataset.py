"""Joint intent detection + slot filling over several SLU corpora (ATIS, SNIPS,
in-house voice assistant logs) with one shared label space.

Smaller corpora are repeated so every corpus contributes roughly the same
number of utterances per epoch.

    torchrun --nproc_per_node=8 07_intent_slot_multidataset.py \
        --corpora atis,snips,va_logs --data_root /data/slu --output_dir /data/runs/slu_joint
"""
import argparse
import json
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModel, AutoTokenizer, get_linear_schedule_with_warmup

PAD_SLOT = -100


def read_corpus(path):
    # one utterance per line: {"tokens": [...], "slots": [...BIO...], "intent": "..."}
    with open(path) as f:
        return [json.loads(l) for l in f]


def build_label_maps(corpora):
    intents, slots = set(), set()
    for rows in corpora:
        for r in rows:
            intents.add(r["intent"])
            slots.update(r["slots"])
    intent2id = {name: i for i, name in enumerate(intents)}
    slot2id = {name: i for i, name in enumerate(slots)}
    return intent2id, slot2id


class SLUDataset(Dataset):
    def __init__(self, rows, tokenizer, intent2id, slot2id, max_len=64):
        self.rows, self.tok, self.max_len = rows, tokenizer, max_len
        self.intent2id, self.slot2id = intent2id, slot2id

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        enc = self.tok(r["tokens"], is_split_into_words=True, truncation=True,
                       max_length=self.max_len, padding="max_length")
        labels, prev = [], None
        for wid in enc.word_ids():
            if wid is None or wid == prev:
                labels.append(PAD_SLOT)
            else:
                labels.append(self.slot2id[r["slots"][wid]])
            prev = wid
        return (torch.tensor(enc["input_ids"]), torch.tensor(enc["attention_mask"]),
                torch.tensor(self.intent2id[r["intent"]]), torch.tensor(labels))


class JointSLU(nn.Module):
    def __init__(self, name, n_intents, n_slots):
        super().__init__()
        self.enc = AutoModel.from_pretrained(name, add_pooling_layer=False)
        h = self.enc.config.hidden_size
        self.drop = nn.Dropout(0.1)
        self.intent_head = nn.Linear(h, n_intents)
        self.slot_head = nn.Linear(h, n_slots)

    def forward(self, ids, mask):
        hs = self.drop(self.enc(input_ids=ids, attention_mask=mask).last_hidden_state)
        return self.intent_head(hs[:, 0]), self.slot_head(hs)


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpora", default="atis,snips,va_logs")
    ap.add_argument("--data_root", required=True)
    ap.add_argument("--output_dir", required=True)
    ap.add_argument("--encoder", default="roberta-base")
    ap.add_argument("--per_device_batch", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--slot_weight", type=float, default=1.0)
    return ap.parse_args()


@torch.no_grad()
def evaluate(net, dev_sets, device, rank, world):
    net.eval()
    res = {}
    for name, ds in dev_sets.items():
        part = Subset(ds, range(rank, len(ds), world))
        c = torch.zeros(4, device=device)  # intent ok, utterances, slot tokens ok, slot tokens
        for ids, mask, intent, slots in DataLoader(part, batch_size=256, num_workers=2):
            ids, mask, intent, slots = ids.to(device), mask.to(device), intent.to(device), slots.to(device)
            il, sl = net(ids, mask)
            valid = slots != PAD_SLOT
            c[0] += (il.argmax(-1) == intent).sum()
            c[1] += intent.numel()
            c[2] += ((sl.argmax(-1) == slots) & valid).sum()
            c[3] += valid.sum()
        dist.all_reduce(c)
        res[name] = {"intent_acc": (c[0] / c[1]).item(), "slot_acc": (c[2] / c[3]).item()}
    net.train()
    return res


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")

    names = args.corpora.split(",")
    train_rows = {n: read_corpus(os.path.join(args.data_root, n, "train.jsonl")) for n in names}
    dev_rows = {n: read_corpus(os.path.join(args.data_root, n, "dev.jsonl")) for n in names}
    intent2id, slot2id = build_label_maps(list(train_rows.values()) + list(dev_rows.values()))

    tok = AutoTokenizer.from_pretrained(args.encoder, add_prefix_space=True)
    largest = max(len(r) for r in train_rows.values())
    parts = []
    for n in names:
        ds = SLUDataset(train_rows[n], tok, intent2id, slot2id)
        repeat = max(1, round(largest / len(ds)))
        parts.extend([ds] * repeat)
        if rank == 0:
            print(f"{n}: {len(ds)} utterances x{repeat}", flush=True)
    train_set = ConcatDataset(parts)
    dev_sets = {n: SLUDataset(dev_rows[n], tok, intent2id, slot2id) for n in names}

    sampler = DistributedSampler(train_set, shuffle=True, seed=0)
    loader = DataLoader(train_set, batch_size=args.per_device_batch, sampler=sampler,
                        num_workers=6, pin_memory=True, drop_last=True)

    model = JointSLU(args.encoder, len(intent2id), len(slot2id)).to(device)
    model = DDP(model, device_ids=[local_rank])
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = args.epochs * len(loader)
    sched = get_linear_schedule_with_warmup(optim, math.ceil(0.05 * total), total)

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        with open(os.path.join(args.output_dir, "labels.json"), "w") as f:
            json.dump({"intent2id": intent2id, "slot2id": slot2id}, f, indent=1)

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for step, (ids, mask, intent, slots) in enumerate(loader):
            ids, mask = ids.to(device, non_blocking=True), mask.to(device, non_blocking=True)
            intent, slots = intent.to(device, non_blocking=True), slots.to(device, non_blocking=True)
            il, sl = model(ids, mask)
            l_int = F.cross_entropy(il, intent)
            l_slot = F.cross_entropy(sl.flatten(0, 1), slots.flatten(), ignore_index=PAD_SLOT)
            loss = l_int + args.slot_weight * l_slot
            optim.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optim.step()
            sched.step()
            if rank == 0 and step % 100 == 0:
                print(f"ep {epoch} {step}/{len(loader)} intent {l_int.item():.4f} slot {l_slot.item():.4f}",
                      flush=True)

        res = evaluate(model.module, dev_sets, device, rank, world)
        score = sum(v["intent_acc"] + v["slot_acc"] for v in res.values()) / (2 * len(res))
        if rank == 0:
            print(f"epoch {epoch} ({time.time() - t0:.0f}s): {json.dumps(res)} score {score:.4f}", flush=True)
            if score > best:
                best = score
                torch.save({"model": model.module.state_dict(), "epoch": epoch,
                            "intent2id": intent2id, "slot2id": slot2id},
                           os.path.join(args.output_dir, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
