"""Joint intent classification + slot filling on XLM-R large, DeepSpeed ZeRO-2.

    deepspeed --hostfile /etc/deepspeed/hostfile --num_nodes 2 --num_gpus 8 \
        13_ds_joint_intent_slot.py --data /nfs/nlu/massive_v2 --out /nfs/nlu/runs/xlmr_joint
"""
import argparse
import json
import os
import time

import deepspeed
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModel, AutoTokenizer

DS_CONFIG = {
    "train_batch_size": 256,
    "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": 4,
    "steps_per_print": 100,
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": 2e-5, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01},
    },
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {"warmup_min_lr": 0, "warmup_max_lr": 2e-5, "warmup_num_steps": 500,
                   "total_num_steps": 20000},
    },
    "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16,
             "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1},
    "zero_optimization": {"stage": 2, "allgather_partitions": True, "overlap_comm": True,
                          "reduce_scatter": True, "contiguous_gradients": True},
    "gradient_clipping": 1.0,
}


class JointModel(nn.Module):
    def __init__(self, name, n_intents, n_slots):
        super().__init__()
        self.enc = AutoModel.from_pretrained(name, add_pooling_layer=False)
        h = self.enc.config.hidden_size
        self.drop = nn.Dropout(0.1)
        self.intent_head = nn.Linear(h, n_intents)
        self.slot_head = nn.Linear(h, n_slots)

    def forward(self, input_ids, attention_mask):
        hs = self.enc(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        hs = self.drop(hs)
        return self.intent_head(hs[:, 0]), self.slot_head(hs)


class NLUData(Dataset):
    def __init__(self, path, tok, intents, slots, max_len=64):
        with open(path) as f:
            self.rows = [json.loads(l) for l in f]
        self.tok, self.intents, self.slots, self.max_len = tok, intents, slots, max_len

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        enc = self.tok(r["tokens"], is_split_into_words=True, truncation=True,
                       max_length=self.max_len, padding="max_length")
        word_ids = enc.word_ids()
        slot_labels, prev = [], None
        for w in word_ids:
            if w is None or w == prev:
                slot_labels.append(-100)
            else:
                slot_labels.append(self.slots[r["slots"][w]])
            prev = w
        return (torch.tensor(enc["input_ids"]), torch.tensor(enc["attention_mask"]),
                torch.tensor(self.intents[r["intent"]]), torch.tensor(slot_labels))


def build_vocab(path):
    # label vocabularies come from a fixed file so every rank maps labels identically
    with open(path) as f:
        v = json.load(f)
    return {k: i for i, k in enumerate(v["intents"])}, {k: i for i, k in enumerate(v["slots"])}


@torch.no_grad()
def evaluate(engine, loader, device):
    engine.module.eval()
    s = torch.zeros(4, device=device)  # intent correct, n, slot correct, slot n
    for ids, att, it, sl in loader:
        ids, att, it, sl = ids.to(device), att.to(device), it.to(device), sl.to(device)
        li, ls = engine.module(ids, att)
        s[0] += (li.argmax(-1) == it).sum()
        s[1] += it.numel()
        m = sl != -100
        s[2] += (ls.argmax(-1)[m] == sl[m]).sum()
        s[3] += m.sum()
    dist.all_reduce(s)
    engine.module.train()
    return (s[0] / s[1]).item(), (s[2] / s[3]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="xlm-roberta-large")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--slot-weight", type=float, default=1.0)
    ap.add_argument("--local_rank", type=int, default=-1)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    deepspeed.init_distributed(dist_backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    intents, slots = build_vocab(os.path.join(args.data, "labels.json"))
    tok = AutoTokenizer.from_pretrained(args.model)
    train_ds = NLUData(os.path.join(args.data, "train.jsonl"), tok, intents, slots)
    dev_ds = NLUData(os.path.join(args.data, "dev.jsonl"), tok, intents, slots)

    model = JointModel(args.model, len(intents), len(slots))
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=DS_CONFIG)
    micro = engine.train_micro_batch_size_per_gpu()
    sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, seed=1)
    train_dl = DataLoader(train_ds, batch_size=micro, sampler=sampler, num_workers=4,
                          pin_memory=True, drop_last=True)
    dev_dl = DataLoader(Subset(dev_ds, range(rank, len(dev_ds), world)), batch_size=64, num_workers=2)
    ce = nn.CrossEntropyLoss(ignore_index=-100)

    ckpt_dir = os.path.join(args.out, "checkpoints")
    start_epoch, best = 0, -1.0
    if os.path.isfile(os.path.join(ckpt_dir, "latest")):
        path, client = engine.load_checkpoint(ckpt_dir)
        if path is not None:
            start_epoch, best = client["epoch"] + 1, client["best"]
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"world={world} micro={micro} gas={engine.gradient_accumulation_steps()} "
              f"start_epoch={start_epoch}", flush=True)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for i, (ids, att, it, sl) in enumerate(train_dl):
            ids, att, it, sl = (ids.to(device, non_blocking=True), att.to(device, non_blocking=True),
                                it.to(device, non_blocking=True), sl.to(device, non_blocking=True))
            li, ls = engine(ids, att)
            loss = ce(li.float(), it) + args.slot_weight * ce(ls.float().view(-1, ls.size(-1)), sl.view(-1))
            engine.backward(loss)
            engine.step()
            if rank == 0 and engine.is_gradient_accumulation_boundary() and engine.global_steps % 50 == 0:
                print(f"ep {epoch} step {engine.global_steps} loss {loss.item():.4f} "
                      f"{time.time() - t0:.0f}s", flush=True)

        intent_acc, slot_acc = evaluate(engine, dev_dl, device)
        score = (intent_acc + slot_acc) / 2
        if score > best:
            best = score
            engine.save_checkpoint(os.path.join(args.out, "best"), tag="best",
                                   client_state={"epoch": epoch, "best": best})
        engine.save_checkpoint(ckpt_dir, tag=f"epoch{epoch}", client_state={"epoch": epoch, "best": best})
        if rank == 0:
            print(f"epoch {epoch}: intent_acc {intent_acc:.4f} slot_acc {slot_acc:.4f} "
                  f"best {best:.4f}", flush=True)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
