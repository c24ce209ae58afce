"""
BEHRT-style masked-code pretraining on longitudinal diagnosis/medication records.

Each patient is a sequence  [CLS] v1_code1 v1_code2 [SEP] v2_code1 ... [SEP]
with visit index as the position id and alternating segment ids per visit.
Age-at-visit is added through a separate embedding (BEHRT).

    torchrun --nproc_per_node=8 10_behrt_mlm_pretrain.py \
        --corpus /datasets/cprd_like/pretrain_seqs.jsonl --vocab /datasets/cprd_like/vocab.txt
"""
import argparse
import json
import math
import os
import random

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import BertConfig, BertForMaskedLM, get_linear_schedule_with_warmup

SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def get_parser():
    parser = argparse.ArgumentParser("BEHRT MLM pretraining")
    parser.add_argument("--corpus", required=True)
    parser.add_argument("--vocab", required=True)
    parser.add_argument("--output_dir", default="/datasets/cprd_like/behrt_pretrain")
    parser.add_argument("--max_len", type=int, default=256)
    parser.add_argument("--max_age", type=int, default=110)
    parser.add_argument("--hidden", type=int, default=288)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-5)
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--mask_prob", type=float, default=0.15)
    parser.add_argument("--save_every", type=int, default=5)
    parser.add_argument("--local_rank", type=int, default=0)
    return parser


class PatientCorpus(Dataset):
    def __init__(self, path, stoi, max_len, mask_prob):
        with open(path) as f:
            self.patients = [json.loads(line) for line in f]
        self.stoi, self.max_len, self.mask_prob = stoi, max_len, mask_prob
        self.pad, self.unk, self.cls, self.sep, self.mask = (stoi[t] for t in SPECIAL)
        self.n_real = len(stoi)

    def __len__(self):
        return len(self.patients)

    def _flatten(self, p):
        ids, ages, pos, seg = [self.cls], [p["visits"][0]["age"]], [0], [0]
        for v_idx, visit in enumerate(p["visits"]):
            for c in visit["codes"] + ["[SEP]"]:
                ids.append(self.stoi.get(c, self.unk))
                ages.append(visit["age"])
                pos.append(v_idx + 1)
                seg.append(v_idx % 2)
        # keep the most recent history
        return ids[-self.max_len:], ages[-self.max_len:], pos[-self.max_len:], seg[-self.max_len:]

    def __getitem__(self, i):
        ids, ages, pos, seg = self._flatten(self.patients[i])
        labels = [-100] * len(ids)
        for k, tok in enumerate(ids):
            if tok in (self.cls, self.sep) or random.random() >= self.mask_prob:
                continue
            labels[k] = tok
            r = random.random()
            if r < 0.8:
                ids[k] = self.mask
            elif r < 0.9:
                ids[k] = random.randrange(len(SPECIAL), self.n_real)
        pos0 = pos[0]
        pos = [p - pos0 for p in pos]
        return ids, ages, pos, seg, labels


def collate(batch, pad_id=0):
    L = max(len(b[0]) for b in batch)

    def pad(seqs, value):
        return torch.tensor([s + [value] * (L - len(s)) for s in seqs])

    ids, ages, pos, seg, labels = zip(*batch)
    input_ids = pad(ids, pad_id)
    return {
        "input_ids": input_ids,
        "age_ids": pad(ages, 0),
        "position_ids": pad(pos, 0),
        "token_type_ids": pad(seg, 0),
        "attention_mask": (input_ids != pad_id).long(),
        "labels": pad(labels, -100),
    }


class BEHRT(nn.Module):
    def __init__(self, vocab_size, args):
        super().__init__()
        cfg = BertConfig(vocab_size=vocab_size, hidden_size=args.hidden, num_hidden_layers=args.layers,
                         num_attention_heads=args.heads, intermediate_size=4 * args.hidden,
                         max_position_embeddings=args.max_len, type_vocab_size=2,
                         hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
        self.bert = BertForMaskedLM(cfg)
        self.age_emb = nn.Embedding(args.max_age + 1, args.hidden)

    def forward(self, input_ids, age_ids, position_ids, token_type_ids, attention_mask, labels):
        emb = self.bert.bert.embeddings.word_embeddings(input_ids) + self.age_emb(age_ids.clamp(max=self.age_emb.num_embeddings - 1))
        out = self.bert(inputs_embeds=emb, position_ids=position_ids, token_type_ids=token_type_ids,
                        attention_mask=attention_mask, labels=labels)
        return out.loss


def main():
    args = get_parser().parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    random.seed(1234 + rank)  # masking differs per rank
    torch.manual_seed(1234)

    with open(args.vocab) as f:
        itos = SPECIAL + [l.strip() for l in f if l.strip() and l.strip() not in SPECIAL]
    stoi = {t: i for i, t in enumerate(itos)}
    ds = PatientCorpus(args.corpus, stoi, args.max_len, args.mask_prob)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=1234)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, collate_fn=collate,
                        num_workers=6, pin_memory=True, drop_last=True,
                        worker_init_fn=lambda w: random.seed(1234 + 100 * rank + w))

    model = BEHRT(len(itos), args).to(device)
    model = DDP(model, device_ids=[args.local_rank])
    no_decay = ("bias", "LayerNorm.weight")
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(k in n for k in no_decay)], "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if any(k in n for k in no_decay)], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=args.lr)
    total = args.epochs * len(loader)
    sched = get_linear_schedule_with_warmup(opt, int(0.05 * total), total)

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        print(f"patients={len(ds)} vocab={len(itos)} world={world} steps/epoch={len(loader)}", flush=True)

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        acc = torch.zeros(2, device=device)
        for batch in loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            loss = model(**batch)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            acc += torch.stack([loss.detach(), torch.ones((), device=device)])
            if rank == 0 and step % 200 == 0:
                print(f"step {step} loss {loss.item():.4f} lr {sched.get_last_lr()[0]:.2e}", flush=True)
        dist.all_reduce(acc)
        mlm = (acc[0] / acc[1]).item()
        if rank == 0:
            print(f"epoch {epoch} mlm_loss {mlm:.4f} ppl {math.exp(min(mlm, 20)):.2f}", flush=True)
            if (epoch + 1) % args.save_every == 0 or epoch + 1 == args.epochs:
                torch.save({"model": model.module.state_dict(), "itos": itos, "args": vars(args),
                            "epoch": epoch}, os.path.join(args.output_dir, f"behrt_ep{epoch + 1}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
