"""
Joint entity + relation extraction for drug / adverse-event mentions in clinical notes.

Shared BERT encoder, a BIO tagging head and a pairwise relation head. During training the relation
head is fed the gold entity spans of the sentence (teacher forcing); at evaluation the predicted
spans are used (end-to-end strict F1).

    torchrun --nproc_per_node=4 08_joint_ner_re.py --data data/ade_notes --out runs/joint_ade
"""
import argparse
import itertools
import json
import logging
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModel, AutoTokenizer, get_linear_schedule_with_warmup

ENT_TAGS = ["O", "B-Drug", "I-Drug", "B-ADE", "I-ADE", "B-Reason", "I-Reason"]
REL_TYPES = ["none", "ADE-Drug", "Reason-Drug"]
logger = logging.getLogger("joint")


def spans_from_tags(tags):
    spans, start, etype = [], None, None
    for i, t in enumerate(tags + ["O"]):
        if t.startswith("B-") or t == "O" or (t.startswith("I-") and t[2:] != etype):
            if start is not None:
                spans.append((start, i - 1, etype))
                start, etype = None, None
            if t.startswith("B-"):
                start, etype = i, t[2:]
    return spans


class JointDataset(Dataset):
    """jsonl: {"tokens": [...], "tags": [...], "relations": [[head_span_idx, tail_span_idx, type], ...]}"""

    def __init__(self, path, tok, max_len):
        self.items = []
        for line in open(path):
            ex = json.loads(line)
            enc = tok(ex["tokens"], is_split_into_words=True, truncation=True, max_length=max_len)
            wids = enc.word_ids()
            first = [j for j, w in enumerate(wids) if w is not None and (j == 0 or wids[j - 1] != w)]
            n = len(first)
            tags = ex["tags"][:n]
            spans = spans_from_tags(tags)
            rel_map = {(h, t): REL_TYPES.index(r) for h, t, r in ex["relations"]}
            pairs = []
            for (i, a), (j, b) in itertools.permutations(enumerate(spans), 2):
                if a[2] == "Drug" or b[2] != "Drug":
                    continue
                pairs.append((first[a[0]], first[b[0]], rel_map.get((i, j), 0)))
            self.items.append({"input_ids": enc["input_ids"], "first": first,
                               "tags": [ENT_TAGS.index(t) for t in tags], "pairs": pairs})

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def collate(batch, pad_id=0):
    L = max(len(b["input_ids"]) for b in batch)
    ids = torch.full((len(batch), L), pad_id)
    tag_lab = torch.full((len(batch), L), -100)
    pairs = []
    for i, b in enumerate(batch):
        ids[i, : len(b["input_ids"])] = torch.tensor(b["input_ids"])
        tag_lab[i, b["first"]] = torch.tensor(b["tags"])
        pairs += [(i, h, t, r) for h, t, r in b["pairs"]]
    pairs = torch.tensor(pairs, dtype=torch.long).view(-1, 4)
    return ids, (ids != pad_id).long(), tag_lab, pairs


class JointModel(nn.Module):
    def __init__(self, name, n_tags, n_rels, dropout=0.1):
        super().__init__()
        self.bert = AutoModel.from_pretrained(name, add_pooling_layer=False)
        h = self.bert.config.hidden_size
        self.drop = nn.Dropout(dropout)
        self.tagger = nn.Linear(h, n_tags)
        self.rel_mlp = nn.Sequential(nn.Linear(3 * h, h), nn.ReLU(), nn.Dropout(dropout), nn.Linear(h, n_rels))

    def forward(self, ids, mask, pairs):
        h = self.drop(self.bert(input_ids=ids, attention_mask=mask).last_hidden_state)
        tag_logits = self.tagger(h)
        rel_logits = None
        if pairs.numel() > 0:
            hh = h[pairs[:, 0], pairs[:, 1]]
            tt = h[pairs[:, 0], pairs[:, 2]]
            rel_logits = self.rel_mlp(torch.cat([hh, tt, hh * tt], dim=-1))
        return tag_logits, rel_logits


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    c = torch.zeros(6, device=device)  # ent tp fp fn, rel tp fp fn
    for ids, mask, tag_lab, gold_pairs in loader:
        ids, mask = ids.to(device), mask.to(device)
        tag_logits, _ = model(ids, mask, torch.empty(0, 4, dtype=torch.long, device=device))
        pred_tags = tag_logits.argmax(-1).cpu()
        pred_pairs = []
        for i in range(ids.size(0)):
            keep = tag_lab[i] != -100
            p_seq = [ENT_TAGS[x] for x in pred_tags[i][keep].tolist()]
            g_seq = [ENT_TAGS[x] for x in tag_lab[i][keep].tolist()]
            ps, gs = set(spans_from_tags(p_seq)), set(spans_from_tags(g_seq))
            c[0] += len(ps & gs)
            c[1] += len(ps - gs)
            c[2] += len(gs - ps)
            pos = keep.nonzero().squeeze(-1)
            plist = sorted(ps)
            for a, b in itertools.permutations(plist, 2):
                if a[2] != "Drug" and b[2] == "Drug":
                    pred_pairs.append((i, int(pos[a[0]]), int(pos[b[0]])))
        gold_rel = {(int(i), int(h), int(t), int(r)) for i, h, t, r in gold_pairs.tolist() if r > 0}
        pred_rel = set()
        if pred_pairs:
            pp = torch.tensor([[i, h, t, 0] for i, h, t in pred_pairs], device=device)
            _, rel_logits = model(ids, mask, pp)
            for (i, h, t), r in zip(pred_pairs, rel_logits.argmax(-1).tolist()):
                if r > 0:
                    pred_rel.add((i, h, t, r))
        c[3] += len(pred_rel & gold_rel)
        c[4] += len(pred_rel - gold_rel)
        c[5] += len(gold_rel - pred_rel)
    dist.all_reduce(c)
    f1 = lambda tp, fp, fn: (2 * tp / max(2 * tp + fp + fn, 1)).item()
    return f1(c[0], c[1], c[2]), f1(c[3], c[4], c[5])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--encoder", default="emilyalsentzer/Bio_ClinicalBERT")
    ap.add_argument("--max_len", type=int, default=160)
    ap.add_argument("--bs", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--rel_weight", type=float, default=1.0)
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--seed", type=int, default=5)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARN, format="%(asctime)s %(message)s")

    tok = AutoTokenizer.from_pretrained(args.encoder)
    train = JointDataset(os.path.join(args.data, "train.jsonl"), tok, args.max_len)
    dev = JointDataset(os.path.join(args.data, "dev.jsonl"), tok, args.max_len)
    coll = lambda b: collate(b, tok.pad_token_id)
    tr_sampler = DistributedSampler(train, shuffle=True, seed=args.seed)
    tr_dl = DataLoader(train, args.bs, sampler=tr_sampler, collate_fn=coll, num_workers=0, drop_last=True)
    dev_shard = Subset(dev, range(rank, len(dev), dist.get_world_size()))
    dev_dl = DataLoader(dev_shard, 32, shuffle=False, collate_fn=coll, num_workers=0)

    model = DDP(JointModel(args.encoder, len(ENT_TAGS), len(REL_TYPES)).to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = len(tr_dl) * args.epochs
    sched = get_linear_schedule_with_warmup(opt, total // 10, total)

    best = -1.0
    for epoch in range(args.epochs):
        tr_sampler.set_epoch(epoch)
        model.train()
        for step, (ids, mask, tag_lab, pairs) in enumerate(tr_dl):
            ids, mask, tag_lab, pairs = ids.to(device), mask.to(device), tag_lab.to(device), pairs.to(device)
            tag_logits, rel_logits = model(ids, mask, pairs)
            loss = F.cross_entropy(tag_logits.view(-1, tag_logits.size(-1)), tag_lab.view(-1), ignore_index=-100)
            if rel_logits is not None:
                loss = loss + args.rel_weight * F.cross_entropy(rel_logits, pairs[:, 3])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            if step % 100 == 0:
                logger.info("epoch %d step %d loss %.4f", epoch, step, loss.item())

        ent_f1, rel_f1 = evaluate(model.module, dev_dl, device)
        logger.info("epoch %d  entity F1 %.4f  relation F1 %.4f", epoch, ent_f1, rel_f1)
        if rank == 0 and rel_f1 > best:
            best = rel_f1
            os.makedirs(args.out, exist_ok=True)
            torch.save(model.module.state_dict(), os.path.join(args.out, "joint_best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
