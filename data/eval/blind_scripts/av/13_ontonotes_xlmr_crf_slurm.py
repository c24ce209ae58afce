"""XLM-R large + linear-chain CRF for OntoNotes 5.0 NER, multi-node Slurm (one task per GPU).

    #!/bin/bash
    #SBATCH -N 2 --ntasks-per-node=4 --gres=gpu:4 --cpus-per-task=8 --time=12:00:00
    srun --kill-on-bad-exit=1 python 13_ontonotes_xlmr_crf_slurm.py \
        --data /project/shared/ontonotes5_conll --out_dir /project/shared/runs/onto_xlmr_crf
"""
import argparse
import os
import subprocess
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModel, AutoTokenizer, get_linear_schedule_with_warmup


def slurm_init(port=29411):
    rank = int(os.environ["SLURM_PROCID"])
    world = int(os.environ["SLURM_NTASKS"])
    local = int(os.environ["SLURM_LOCALID"])
    if "MASTER_ADDR" not in os.environ:
        hosts = subprocess.check_output(["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]])
        os.environ["MASTER_ADDR"] = hosts.split()[0].decode()
    os.environ.setdefault("MASTER_PORT", str(port))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", init_method="env://", rank=rank, world_size=world)
    return rank, world, local


class CRF(nn.Module):
    def __init__(self, num_tags):
        super().__init__()
        self.start = nn.Parameter(torch.empty(num_tags).uniform_(-0.1, 0.1))
        self.end = nn.Parameter(torch.empty(num_tags).uniform_(-0.1, 0.1))
        self.trans = nn.Parameter(torch.empty(num_tags, num_tags).uniform_(-0.1, 0.1))

    def nll(self, em, tags, mask):
        # em: B x T x K (float32), tags: B x T, mask: B x T bool with mask[:, 0] all True
        B, T, _ = em.shape
        score = self.start[tags[:, 0]] + em[:, 0].gather(1, tags[:, :1]).squeeze(1)
        for t in range(1, T):
            step = self.trans[tags[:, t - 1], tags[:, t]] + em[:, t].gather(1, tags[:, t:t + 1]).squeeze(1)
            score = score + step * mask[:, t]
        last = tags.gather(1, (mask.sum(1) - 1).unsqueeze(1)).squeeze(1)
        score = score + self.end[last]
        alpha = self.start + em[:, 0]
        for t in range(1, T):
            nxt = torch.logsumexp(alpha.unsqueeze(2) + self.trans + em[:, t].unsqueeze(1), dim=1)
            alpha = torch.where(mask[:, t].unsqueeze(1), nxt, alpha)
        log_z = torch.logsumexp(alpha + self.end, dim=1)
        return (log_z - score).mean()

    @torch.no_grad()
    def viterbi(self, em, mask):
        B, T, _ = em.shape
        score = self.start + em[:, 0]
        history = []
        for t in range(1, T):
            best, idx = (score.unsqueeze(2) + self.trans).max(1)
            nxt = best + em[:, t]
            score = torch.where(mask[:, t].unsqueeze(1), nxt, score)
            history.append(idx)
        score = score + self.end
        lengths = mask.sum(1).tolist()
        paths = []
        for b in range(B):
            tag = score[b].argmax().item()
            path = [tag]
            for t in range(lengths[b] - 1, 0, -1):
                tag = history[t - 1][b, tag].item()
                path.append(tag)
            paths.append(path[::-1])
        return paths


class Tagger(nn.Module):
    def __init__(self, name, num_tags):
        super().__init__()
        self.enc = AutoModel.from_pretrained(name, add_pooling_layer=False)
        self.drop = nn.Dropout(0.2)
        self.proj = nn.Linear(self.enc.config.hidden_size, num_tags)
        self.crf = CRF(num_tags)

    def emissions(self, input_ids, attention_mask, word_index):
        h = self.enc(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        h = h.gather(1, word_index.unsqueeze(-1).expand(-1, -1, h.size(-1)))
        return self.proj(self.drop(h)).float()

    def forward(self, input_ids, attention_mask, word_index, word_mask, tags):
        return self.crf.nll(self.emissions(input_ids, attention_mask, word_index), tags, word_mask)


def read_conll(path):
    sents, w, t = [], [], []
    for line in open(path, encoding="utf-8"):
        line = line.rstrip()
        if not line:
            if w:
                sents.append((w, t))
            w, t = [], []
            continue
        tok, tag = line.split("\t")[0], line.split("\t")[-1]
        w.append(tok)
        t.append(tag)
    if w:
        sents.append((w, t))
    return sents


def featurize(sents, tok, label2id, max_len=512):
    feats = []
    for words, tags in sents:
        enc = tok(words, is_split_into_words=True, truncation=True, max_length=max_len)
        first = {}
        for pos, wid in enumerate(enc.word_ids()):
            if wid is not None and wid not in first:
                first[wid] = pos
        n = len(first)
        feats.append((enc["input_ids"], [first[i] for i in range(n)], [label2id[x] for x in tags[:n]]))
    return feats


def collate(batch, pad_id=1):
    T = max(len(b[0]) for b in batch)
    W = max(len(b[1]) for b in batch)
    ids = torch.full((len(batch), T), pad_id)
    am = torch.zeros((len(batch), T), dtype=torch.long)
    widx = torch.zeros((len(batch), W), dtype=torch.long)
    wmask = torch.zeros((len(batch), W), dtype=torch.bool)
    tags = torch.zeros((len(batch), W), dtype=torch.long)
    for i, (x, f, y) in enumerate(batch):
        ids[i, :len(x)], am[i, :len(x)] = torch.tensor(x), 1
        widx[i, :len(f)], wmask[i, :len(f)], tags[i, :len(y)] = torch.tensor(f), True, torch.tensor(y)
    return ids, am, widx, wmask, tags


def spans(labels):
    out, start, typ = set(), None, None
    for i, l in enumerate(labels + ["O"]):
        if l == "O" or l.startswith("B-") or (l.startswith("I-") and l[2:] != typ):
            if start is not None:
                out.add((start, i, typ))
            start, typ = (i, l[2:]) if l != "O" else (None, None)
    return out


@torch.no_grad()
def span_f1(model, feats, sents, id2label, device, rank, world, bsz=64):
    model.eval()
    counts = torch.zeros(3, dtype=torch.float64, device=device)  # tp, n_pred, n_gold
    mine = list(range(rank, len(feats), world))  # disjoint shards: nothing counted twice
    for s in range(0, len(mine), bsz):
        idx = mine[s:s + bsz]
        ids, am, widx, wmask, _ = collate([feats[i] for i in idx])
        with torch.autocast("cuda", dtype=torch.bfloat16):
            em = model.emissions(ids.to(device), am.to(device), widx.to(device))
        for i, path in zip(idx, model.crf.viterbi(em, wmask.to(device))):
            pred = spans([id2label[p] for p in path])
            gold = spans(sents[i][1][:len(path)])
            counts += torch.tensor([len(pred & gold), len(pred), len(gold)], dtype=torch.float64, device=device)
    dist.all_reduce(counts)
    model.train()
    tp, npred, ngold = counts.tolist()
    p, r = tp / max(npred, 1), tp / max(ngold, 1)
    return 2 * p * r / max(p + r, 1e-12)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out_dir", required=True)
    ap.add_argument("--model", default="xlm-roberta-large")
    ap.add_argument("--bsz", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--head_lr", type=float, default=1e-3)
    args = ap.parse_args()

    rank, world, local = slurm_init()
    device = torch.device("cuda", local)
    torch.manual_seed(0)

    train = read_conll(os.path.join(args.data, "train.conll"))
    dev = read_conll(os.path.join(args.data, "dev.conll"))
    labels = sorted({t for _, ts in train for t in ts})  # deterministic order on every rank
    label2id = {l: i for i, l in enumerate(labels)}
    id2label = dict(enumerate(labels))
    tok = AutoTokenizer.from_pretrained(args.model)
    train_f, dev_f = featurize(train, tok, label2id), featurize(dev, tok, label2id)

    sampler = DistributedSampler(train_f, num_replicas=world, rank=rank, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(train_f, batch_size=args.bsz, sampler=sampler, collate_fn=collate, num_workers=4)

    model = Tagger(args.model, len(labels)).to(device)
    start_epoch, best = 0, -1.0
    last_path = os.path.join(args.out_dir, "last.pt")
    ckpt = torch.load(last_path, map_location="cpu") if os.path.exists(last_path) else None
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        start_epoch, best = ckpt["epoch"] + 1, ckpt["best"]
    ddp = DDP(model, device_ids=[local])

    enc_p = [p for n, p in model.named_parameters() if n.startswith("enc.")]
    head_p = [p for n, p in model.named_parameters() if not n.startswith("enc.")]
    opt = torch.optim.AdamW([{"params": enc_p, "lr": args.lr}, {"params": head_p, "lr": args.head_lr}],
                            weight_decay=0.01)
    total = len(loader) * args.epochs
    sched = get_linear_schedule_with_warmup(opt, int(0.05 * total), total)
    if ckpt is not None:
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
        print(f"world={world} labels={len(labels)} train={len(train_f)} steps={total}", flush=True)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        t0, run = time.time(), torch.zeros(2, device=device)
        for ids, am, widx, wmask, tags in loader:
            ids, am, widx = ids.to(device), am.to(device), widx.to(device)
            wmask, tags = wmask.to(device), tags.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = ddp(ids, am, widx, wmask, tags)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            run += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(run)
        f1 = span_f1(model, dev_f, dev, id2label, device, rank, world)
        if rank == 0:
            print(f"epoch {epoch} loss {(run[0] / run[1]).item():.4f} dev span-F1 {100 * f1:.2f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            if f1 > best:
                best = f1
                torch.save({"model": model.state_dict(), "labels": labels}, os.path.join(args.out_dir, "best.pt"))
            state = {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                     "epoch": epoch, "best": best}
            torch.save(state, last_path + ".tmp")
            os.replace(last_path + ".tmp", last_path)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
