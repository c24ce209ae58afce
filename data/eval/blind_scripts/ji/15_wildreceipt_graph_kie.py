"""Graph-based KIE on WildReceipt (SDMG-R style): text boxes are nodes, edges connect
each box to its nearest neighbours, nodes are classified into 26 key/value classes.

    torchrun --nproc_per_node=4 15_wildreceipt_graph_kie.py --root data/wildreceipt
"""
import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

IGNORE = 0


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="data/wildreceipt")
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--bs", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--knn", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--work_dir", default="work_dirs/wildreceipt_gnn")
    return p.parse_args()


def load_vocab(root):
    with open(os.path.join(root, "dict.txt"), encoding="utf-8") as f:
        chars = [ln.rstrip("\n") for ln in f if ln.rstrip("\n")]
    return {c: i + 2 for i, c in enumerate(chars)}  # 0 pad, 1 unk


def load_classes(root):
    with open(os.path.join(root, "class_list.txt")) as f:
        return [ln.split(maxsplit=1)[1].strip() for ln in f if ln.strip()]


class WildReceipt(Dataset):
    def __init__(self, root, split, vocab, max_chars=40):
        with open(os.path.join(root, f"{split}.txt"), encoding="utf-8") as f:
            self.samples = [json.loads(ln) for ln in f if ln.strip()]
        self.vocab = vocab
        self.max_chars = max_chars

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        s = self.samples[i]
        w, h = float(s["width"]), float(s["height"])
        anns = [a for a in s["annotations"] if a["text"].strip()]
        chars = torch.zeros(len(anns), self.max_chars, dtype=torch.long)
        boxes = torch.zeros(len(anns), 4)
        labels = torch.zeros(len(anns), dtype=torch.long)
        for k, a in enumerate(anns):
            ids = [self.vocab.get(c, 1) for c in a["text"][: self.max_chars]]
            chars[k, : len(ids)] = torch.tensor(ids)
            xs, ys = a["box"][0::2], a["box"][1::2]
            boxes[k] = torch.tensor([min(xs) / w, min(ys) / h, max(xs) / w, max(ys) / h])
            labels[k] = a["label"]
        return chars, boxes, labels


def collate(batch):
    chars, boxes, labels, graph = [], [], [], []
    for g, (c, b, l) in enumerate(batch):
        chars.append(c)
        boxes.append(b)
        labels.append(l)
        graph.append(torch.full((len(l),), g, dtype=torch.long))
    return torch.cat(chars), torch.cat(boxes), torch.cat(labels), torch.cat(graph)


class GraphKIE(nn.Module):
    def __init__(self, vocab_size, n_classes, hidden=256, knn=8, layers=2):
        super().__init__()
        self.knn = knn
        self.emb = nn.Embedding(vocab_size, 64, padding_idx=0)
        self.char_rnn = nn.LSTM(64, hidden // 2, batch_first=True, bidirectional=True)
        self.box_mlp = nn.Sequential(nn.Linear(6, hidden), nn.ReLU(), nn.Linear(hidden, hidden))
        self.edge_mlp = nn.Sequential(nn.Linear(5, hidden), nn.ReLU())
        self.gnn = nn.ModuleList([nn.Linear(3 * hidden, hidden) for _ in range(layers)])
        self.norms = nn.ModuleList([nn.LayerNorm(hidden) for _ in range(layers)])
        self.cls = nn.Linear(hidden, n_classes)

    def encode_text(self, chars):
        lengths = (chars != 0).sum(1).clamp(min=1).cpu()
        packed = nn.utils.rnn.pack_padded_sequence(self.emb(chars), lengths, batch_first=True, enforce_sorted=False)
        _, (h, _) = self.char_rnn(packed)
        return torch.cat([h[0], h[1]], dim=-1)

    def build_edges(self, boxes, graph):
        centers = (boxes[:, :2] + boxes[:, 2:]) / 2
        dist_mat = torch.cdist(centers, centers)
        dist_mat = dist_mat.masked_fill(graph[:, None] != graph[None, :], float("inf"))
        dist_mat.fill_diagonal_(float("inf"))
        k = min(self.knn, boxes.size(0) - 1)
        nbr = dist_mat.topk(k, largest=False).indices
        src = torch.arange(boxes.size(0), device=boxes.device).repeat_interleave(k)
        dst = nbr.reshape(-1)
        valid = torch.isfinite(dist_mat[src, dst])
        return src[valid], dst[valid]

    def forward(self, chars, boxes, graph):
        wh = boxes[:, 2:] - boxes[:, :2]
        x = self.encode_text(chars) + self.box_mlp(torch.cat([boxes, wh], -1))
        src, dst = self.build_edges(boxes, graph)
        rel = torch.cat([boxes[dst, :2] - boxes[src, :2], wh[dst] / wh[src].clamp(min=1e-3),
                         (wh[src, 0] / wh[src, 1].clamp(min=1e-3))[:, None]], -1)
        e = self.edge_mlp(rel)
        for lin, norm in zip(self.gnn, self.norms):
            msg = torch.relu(lin(torch.cat([x[src], x[dst], e], -1)))
            agg = torch.zeros_like(x).index_add_(0, src, msg)
            deg = torch.zeros(x.size(0), device=x.device).index_add_(0, src, torch.ones_like(src, dtype=x.dtype))
            x = norm(x + agg / deg.clamp(min=1)[:, None])
        return self.cls(x)


@torch.no_grad()
def evaluate(model, loader, n_cls, device):
    model.eval()
    cm = torch.zeros(n_cls, n_cls, dtype=torch.long, device=device)
    for chars, boxes, labels, graph in loader:
        if labels.numel() < 2:
            continue
        logits = model(chars.to(device), boxes.to(device), graph.to(device))
        cm += torch.bincount(labels.to(device) * n_cls + logits.argmax(-1), minlength=n_cls * n_cls).view(n_cls, n_cls)
    dist.all_reduce(cm)
    model.train()
    tp = cm.diag().float()
    f1 = 2 * tp / (cm.sum(0) + cm.sum(1)).clamp(min=1).float()
    # report the mean over the key/value classes, without Ignore (first) and Others (last)
    eval_ids = [i for i in range(1, n_cls - 1)]
    return f1[eval_ids].mean().item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    vocab = load_vocab(args.root)
    classes = load_classes(args.root)
    train_ds = WildReceipt(args.root, "train", vocab)
    test_ds = WildReceipt(args.root, "test", vocab)
    sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, collate_fn=collate,
                          num_workers=4, drop_last=True)
    test_dl = DataLoader(torch.utils.data.Subset(test_ds, range(rank, len(test_ds), world)), batch_size=1,
                         collate_fn=collate, num_workers=2)

    model = GraphKIE(len(vocab) + 2, len(classes), args.hidden, args.knn).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[40, 50], gamma=0.1)

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        run_loss, n = 0.0, 0
        for chars, boxes, labels, graph in train_dl:
            labels = labels.to(device)
            if (labels != IGNORE).sum() == 0:
                continue
            logits = model(chars.to(device), boxes.to(device), graph.to(device))
            loss = F.cross_entropy(logits, labels, ignore_index=IGNORE)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            run_loss += loss.item()
            n += 1
        sched.step()

        macro_f1 = evaluate(model.module, test_dl, len(classes), device)
        if rank == 0:
            print(f"epoch {epoch:02d} loss {run_loss / max(n, 1):.4f} macro-F1 {macro_f1:.4f}", flush=True)
            os.makedirs(args.work_dir, exist_ok=True)
            torch.save(model.module.state_dict(), os.path.join(args.work_dir, "latest.pth"))
            if macro_f1 > best:
                best = macro_f1
                torch.save(model.module.state_dict(), os.path.join(args.work_dir, "best.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
