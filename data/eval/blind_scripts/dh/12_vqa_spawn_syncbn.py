"""Stacked-attention VQA baseline (ResNet-152 grid features + LSTM question encoder),
backbone fine-tuned end to end, single node, processes started with mp.spawn.

Inputs come from preprocess_vqa.py: vocab.json (question words, answer list sorted
by frequency then alphabetically) and {train,val}_qa.json.

    python 12_vqa_spawn_syncbn.py --data /data/vqa_prepro --gpus 4
"""
import argparse
import contextlib
import json
import os
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils.rnn import pack_padded_sequence
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms


class VQAData(Dataset):
    def __init__(self, qa_file, image_root, n_answers, transform, max_q=14):
        with open(qa_file) as f:
            self.items = json.load(f)
        self.image_root, self.n_answers, self.transform, self.max_q = image_root, n_answers, transform, max_q

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        it = self.items[i]
        img = self.transform(Image.open(os.path.join(self.image_root, it["image_path"])).convert("RGB"))
        q = it["question_tokens"][: self.max_q]
        q_len = max(len(q), 1)
        q = torch.tensor(q + [0] * (self.max_q - len(q)), dtype=torch.long)
        target = torch.zeros(self.n_answers)
        for idx, s in it["answer_scores"].items():
            target[int(idx)] = s
        return img, q, q_len, target, it["question_id"]


class StackedAttention(nn.Module):
    def __init__(self, d_img, d_q, d_att):
        super().__init__()
        self.img = nn.Linear(d_img, d_att)
        self.q = nn.Linear(d_q, d_att)
        self.out = nn.Linear(d_att, 1)

    def forward(self, v, u):
        h = torch.tanh(self.img(v) + self.q(u).unsqueeze(1))
        p = self.out(h).softmax(dim=1)
        return (p * v).sum(1) + u


class SAN(nn.Module):
    def __init__(self, vocab_size, n_answers, d=1024, hops=2):
        super().__init__()
        resnet = torchvision.models.resnet152(weights="IMAGENET1K_V2")
        self.backbone = nn.Sequential(*list(resnet.children())[:-2])
        self.img_proj = nn.Sequential(nn.Conv2d(2048, d, 1), nn.BatchNorm2d(d), nn.ReLU(inplace=True))
        self.embed = nn.Embedding(vocab_size, 300, padding_idx=0)
        self.lstm = nn.LSTM(300, d, batch_first=True)
        self.hops = nn.ModuleList(StackedAttention(d, d, 512) for _ in range(hops))
        self.classifier = nn.Sequential(nn.Dropout(0.5), nn.Linear(d, n_answers))

    def forward(self, img, q, q_len):
        v = self.img_proj(self.backbone(img)).flatten(2).transpose(1, 2)  # B, HW, d
        packed = pack_padded_sequence(self.embed(q), q_len.cpu(), batch_first=True, enforce_sorted=False)
        _, (h, _) = self.lstm(packed)
        u = h[-1]
        for hop in self.hops:
            u = hop(v, u)
        return self.classifier(u)


def vqa_accuracy(pred, answers):
    return sum(min(1.0, sum(a == pred for j, a in enumerate(answers) if j != i) / 3) for i in range(10)) / 10


def main_worker(rank, world_size, args):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{args.port}",
                            rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    torch.manual_seed(args.seed)

    with open(os.path.join(args.data, "vocab.json")) as f:
        vocab = json.load(f)
    answers = vocab["answers"]
    norm = transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    tf = transforms.Compose([transforms.Resize((448, 448)), transforms.ToTensor(), norm])
    train_set = VQAData(os.path.join(args.data, "train_qa.json"), args.images, len(answers), tf)
    val_set = VQAData(os.path.join(args.data, "val_qa.json"), args.images, len(answers), tf)
    val_meta = {it["question_id"]: it for it in val_set.items}

    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True)
    val_sampler = DistributedSampler(val_set, num_replicas=world_size, rank=rank, shuffle=False)
    train_loader = DataLoader(train_set, args.batch_size, sampler=train_sampler, num_workers=6,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_set, 64, sampler=val_sampler, num_workers=6, pin_memory=True)

    model = SAN(len(vocab["words"]) + 1, len(answers))
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[rank])

    # linear scaling rule, reference lr is for a global batch of 256
    global_batch = args.batch_size * world_size * args.accum
    lr = args.base_lr * global_batch / 256
    optimizer = torch.optim.Adam([
        {"params": model.module.backbone.parameters(), "lr": lr * 0.1},
        {"params": [p for n, p in model.module.named_parameters() if not n.startswith("backbone.")], "lr": lr},
    ])
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[10, 14], gamma=0.1)

    start_epoch = 0
    ckpt_path = os.path.join(args.out, "checkpoint.pt")
    if os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location=device)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch = ckpt["epoch"] + 1
        del ckpt

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        optimizer.zero_grad(set_to_none=True)
        for i, (img, q, q_len, target, _) in enumerate(train_loader):
            img, q, target = img.to(device, non_blocking=True), q.to(device), target.to(device)
            sync_now = (i + 1) % args.accum == 0
            with contextlib.nullcontext() if sync_now else model.no_sync():
                logits = model(img, q, q_len)
                loss = F.binary_cross_entropy_with_logits(logits, target) * target.size(1) / args.accum
                loss.backward()
            if sync_now:
                nn.utils.clip_grad_norm_(model.parameters(), 0.25)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            if i % 500 == 0:
                l = loss.detach() * args.accum
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"epoch {epoch} it {i}/{len(train_loader)} loss {l.item():.3f}", flush=True)
        scheduler.step()

        # every rank holds the same number of (padded) val samples, so the gathered shapes match
        model.eval()
        preds, qids = [], []
        with torch.no_grad():
            for img, q, q_len, _, qid in val_loader:
                logits = model(img.to(device, non_blocking=True), q.to(device), q_len)
                preds.append(logits.argmax(1))
                qids.append(qid.to(device))
        preds, qids = torch.cat(preds), torch.cat(qids)
        all_preds = [torch.empty_like(preds) for _ in range(world_size)]
        all_qids = [torch.empty_like(qids) for _ in range(world_size)]
        dist.all_gather(all_preds, preds)
        dist.all_gather(all_qids, qids)

        if rank == 0:
            result = dict(zip(torch.cat(all_qids).tolist(), torch.cat(all_preds).tolist()))
            per_type, accs = defaultdict(list), []
            for qid, p in result.items():
                meta = val_meta[qid]
                a = vqa_accuracy(answers[p], meta["answers"])
                accs.append(a)
                per_type[meta["answer_type"]].append(a)
            summary = {"overall": 100 * sum(accs) / len(accs),
                       **{k: 100 * sum(v) / len(v) for k, v in per_type.items()}}
            print(f"epoch {epoch} val ({len(result)} questions): {summary}", flush=True)
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch}, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--images", default="/data/coco")
    parser.add_argument("--out", default="checkpoints/san")
    parser.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    parser.add_argument("--port", type=int, default=29533)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--accum", type=int, default=2)
    parser.add_argument("--base_lr", type=float, default=3e-4)
    parser.add_argument("--epochs", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    mp.spawn(main_worker, args=(args.gpus, args), nprocs=args.gpus, join=True)
