"""Two-view (PA + lateral) IU X-Ray report generation: ResNet-50 + attention LSTM.

Annotation format follows R2Gen (annotation.json with train/val/test lists).
Run:  torchrun --standalone --nproc_per_node=4 04_iuxray_resnet_lstm.py --ann data/iu_xray/annotation.json
"""
import argparse
import json
import os
import re
from collections import Counter

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from PIL import Image
from pycocoevalcap.bleu.bleu import Bleu
from pycocoevalcap.meteor import Meteor
from pycocoevalcap.rouge import Rouge
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms


def clean_report(text):
    text = text.lower().replace("..", ".")
    text = re.sub(r"[^a-z0-9\s\.]", " ", text)
    text = re.sub(r"\s+", " ", text).strip()
    return text


class Vocab:
    def __init__(self, reports, min_freq=3):
        counts = Counter(w for r in reports for w in clean_report(r).split())
        words = sorted((w for w, c in counts.items() if c >= min_freq), key=lambda w: (-counts[w], w))
        self.itos = ["<pad>", "<bos>", "<eos>", "<unk>"] + words
        self.stoi = {w: i for i, w in enumerate(self.itos)}

    def __len__(self):
        return len(self.itos)

    def encode(self, text, max_len):
        ids = [self.stoi.get(w, 3) for w in clean_report(text).split()][: max_len - 2]
        ids = [1] + ids + [2]
        return ids + [0] * (max_len - len(ids))

    def decode(self, ids):
        out = []
        for i in ids:
            if i == 2:
                break
            if i > 3:
                out.append(self.itos[i])
        return " ".join(out)


class IUXray(Dataset):
    def __init__(self, items, root, vocab, max_len, train):
        self.items, self.root, self.vocab, self.max_len = items, root, vocab, max_len
        aug = [transforms.RandomCrop(224)] if train else [transforms.CenterCrop(224)]
        self.tf = transforms.Compose([transforms.Resize(256)] + aug + [
            transforms.ToTensor(), transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        it = self.items[i]
        views = [self.tf(Image.open(os.path.join(self.root, p)).convert("RGB")) for p in it["image_path"][:2]]
        tokens = torch.tensor(self.vocab.encode(it["report"], self.max_len))
        return torch.stack(views), tokens, i


class AttnLSTMReporter(nn.Module):
    def __init__(self, vocab_size, emb=512, hid=512, att=512):
        super().__init__()
        resnet = torchvision.models.resnet50(weights="IMAGENET1K_V2")
        self.cnn = nn.Sequential(*list(resnet.children())[:-2])
        self.feat_dim = 2048
        self.embed = nn.Embedding(vocab_size, emb, padding_idx=0)
        self.init_h = nn.Linear(self.feat_dim, hid)
        self.init_c = nn.Linear(self.feat_dim, hid)
        self.att_feat = nn.Linear(self.feat_dim, att)
        self.att_hid = nn.Linear(hid, att)
        self.att_out = nn.Linear(att, 1)
        self.gate = nn.Linear(hid, self.feat_dim)
        self.cell = nn.LSTMCell(emb + self.feat_dim, hid)
        self.drop = nn.Dropout(0.3)
        self.fc = nn.Linear(hid, vocab_size)

    def encode(self, views):
        B, V = views.shape[:2]
        f = self.cnn(views.flatten(0, 1))                      # B*V, 2048, 7, 7
        f = f.flatten(2).transpose(1, 2)                       # B*V, 49, 2048
        return f.reshape(B, V * f.size(1), self.feat_dim)      # B, 98, 2048

    def step(self, feats, proj, word, h, c):
        e = self.att_out(torch.tanh(proj + self.att_hid(h).unsqueeze(1))).squeeze(2)
        alpha = e.softmax(1)
        ctx = (feats * alpha.unsqueeze(2)).sum(1) * torch.sigmoid(self.gate(h))
        h, c = self.cell(torch.cat([self.embed(word), ctx], 1), (h, c))
        return self.fc(self.drop(h)), h, c

    def forward(self, views, tokens):
        feats = self.encode(views)
        proj = self.att_feat(feats)
        mean = feats.mean(1)
        h, c = torch.tanh(self.init_h(mean)), torch.tanh(self.init_c(mean))
        logits = []
        for t in range(tokens.size(1) - 1):
            out, h, c = self.step(feats, proj, tokens[:, t], h, c)
            logits.append(out)
        return torch.stack(logits, 1)

    @torch.no_grad()
    def sample(self, views, max_len=60):
        feats = self.encode(views)
        proj = self.att_feat(feats)
        mean = feats.mean(1)
        h, c = torch.tanh(self.init_h(mean)), torch.tanh(self.init_c(mean))
        word = torch.ones(views.size(0), dtype=torch.long, device=views.device)
        out = []
        for _ in range(max_len):
            logit, h, c = self.step(feats, proj, word, h, c)
            word = logit.argmax(1)
            out.append(word)
        return torch.stack(out, 1)


def coco_scores(gts, res):
    scores = {}
    bleu, _ = Bleu(4).compute_score(gts, res, verbose=0)
    scores.update({f"BLEU_{i + 1}": b for i, b in enumerate(bleu)})
    scores["METEOR"], _ = Meteor().compute_score(gts, res)
    scores["ROUGE_L"], _ = Rouge().compute_score(gts, res)
    return scores


def evaluate(model, loader, vocab, args, rank, world):
    model.eval()
    preds = []
    for views, _, idx in loader:
        seqs = model.sample(views.cuda(non_blocking=True), max_len=args.max_len)
        preds.extend((int(i), vocab.decode(s.tolist())) for i, s in zip(idx, seqs))
    model.train()
    everything = [None] * world
    dist.all_gather_object(everything, preds)
    if rank != 0:
        return None
    res = {i: [p if p else "."] for part in everything for i, p in part}
    gts = {i: [clean_report(loader.dataset.items[i]["report"])] for i in res}
    return coco_scores(gts, res)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ann", default="data/iu_xray/annotation.json")
    ap.add_argument("--images", default="data/iu_xray/images")
    ap.add_argument("--save-dir", default="results/iu_xray_lstm")
    ap.add_argument("--max-len", type=int, default=60)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--lr-cnn", type=float, default=5e-5)
    ap.add_argument("--lr", type=float, default=5e-4)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()

    with open(args.ann) as f:
        ann = json.load(f)
    vocab = Vocab([x["report"] for x in ann["train"]])
    train_set = IUXray(ann["train"], args.images, vocab, args.max_len, True)
    val_set = IUXray(ann["val"], args.images, vocab, args.max_len, False)
    train_sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=4, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size,
                            sampler=DistributedSampler(val_set, shuffle=False),
                            num_workers=4, pin_memory=True)

    model = AttnLSTMReporter(len(vocab))
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).cuda()
    model = DistributedDataParallel(model, device_ids=[local_rank])
    cnn_params = list(model.module.cnn.parameters())
    cnn_ids = set(map(id, cnn_params))
    optimizer = torch.optim.Adam([
        {"params": cnn_params, "lr": args.lr_cnn},
        {"params": [p for p in model.parameters() if id(p) not in cnn_ids], "lr": args.lr},
    ], weight_decay=5e-5)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.8)

    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
        print(f"vocab {len(vocab)} | train {len(train_set)} | val {len(val_set)} | world {world}")
    best_bleu4 = 0.0
    for epoch in range(1, args.epochs + 1):
        train_sampler.set_epoch(epoch)
        loss_acc = torch.zeros(2, device="cuda")
        for views, tokens, _ in train_loader:
            views = views.cuda(non_blocking=True)
            tokens = tokens.cuda(non_blocking=True)
            logits = model(views, tokens)
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1),
                                   ignore_index=0)
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_value_(model.parameters(), 0.1)
            optimizer.step()
            loss_acc += torch.stack([loss.detach(), torch.ones_like(loss)])
        scheduler.step()
        dist.all_reduce(loss_acc)

        scores = evaluate(model, val_loader, vocab, args, rank, world)
        if rank == 0:
            print(f"epoch {epoch} train_loss {(loss_acc[0] / loss_acc[1]).item():.4f} "
                  + " ".join(f"{k} {v:.4f}" for k, v in scores.items()))
            if scores["BLEU_4"] > best_bleu4:
                best_bleu4 = scores["BLEU_4"]
                torch.save({"epoch": epoch, "state_dict": model.module.state_dict(),
                            "optimizer": optimizer.state_dict(), "vocab": vocab.itos,
                            "scores": scores}, os.path.join(args.save_dir, "model_best.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
