"""VQAv2 classifier with a ViT-L/16 image tower and a BERT question tower,
plus an auxiliary counting head trained on "number" questions.

ViT-L at 384px does not fit at batch 32 without activation checkpointing.

torchrun --nproc_per_node=8 16_vitl_vqa_count_head.py --data /data/vqav2 --grad_ckpt
"""
import argparse
import json
import os
from collections import Counter, defaultdict

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms

import timm
from transformers import BertModel, BertTokenizerFast, get_cosine_schedule_with_warmup

MAX_COUNT = 10


class VQA(Dataset):
    def __init__(self, data, split, ans2idx, tf):
        qs = json.load(open(f"{data}/v2_OpenEnded_mscoco_{split}2014_questions.json"))["questions"]
        anns = {a["question_id"]: a for a in json.load(open(f"{data}/v2_mscoco_{split}2014_annotations.json"))["annotations"]}
        self.rows = []
        for q in qs:
            a = anns[q["question_id"]]
            answers = [x["answer"] for x in a["answers"]]
            mc = a["multiple_choice_answer"]
            count = int(mc) if a["answer_type"] == "number" and mc.isdigit() and int(mc) <= MAX_COUNT else -1
            self.rows.append((q["question_id"], q["image_id"], q["question"], answers, count,
                              a["answer_type"], a["question_type"]))
        self.data, self.split, self.ans2idx, self.tf = data, split, ans2idx, tf

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        qid, img_id, question, answers, count, _, _ = self.rows[i]
        img = Image.open(f"{self.data}/{self.split}2014/COCO_{self.split}2014_{img_id:012d}.jpg").convert("RGB")
        target = torch.zeros(len(self.ans2idx))
        for ans, c in Counter(answers).items():
            if ans in self.ans2idx:
                target[self.ans2idx[ans]] = min(1.0, c / 3)
        return self.tf(img), question, target, count, qid


class VQAModel(nn.Module):
    def __init__(self, n_answers, grad_ckpt=False, d=1024):
        super().__init__()
        self.vit = timm.create_model("vit_large_patch16_384.augreg_in21k_ft_in1k", pretrained=True, num_classes=0)
        self.bert = BertModel.from_pretrained("bert-large-uncased", add_pooling_layer=False)
        self.grad_ckpt = grad_ckpt
        self.fuse = nn.MultiheadAttention(d, 16, batch_first=True)
        self.fuse_norm = nn.LayerNorm(d)
        self.answer_head = nn.Sequential(nn.Linear(2 * d, 2 * d), nn.GELU(), nn.LayerNorm(2 * d),
                                         nn.Linear(2 * d, n_answers))
        self.count_head = nn.Sequential(nn.Linear(2 * d, d), nn.GELU(), nn.Linear(d, MAX_COUNT + 1))

    def image_tokens(self, images):
        v = self.vit
        x = v._pos_embed(v.patch_embed(images))
        x = v.norm_pre(x)
        for blk in v.blocks:
            x = checkpoint(blk, x) if self.grad_ckpt and self.training else blk(x)
        return v.norm(x)

    def forward(self, images, q_ids, q_mask, count_mask=None):
        img = self.image_tokens(images)
        q = self.bert(input_ids=q_ids, attention_mask=q_mask).last_hidden_state
        attended = self.fuse(q, img, img, need_weights=False)[0]
        q = self.fuse_norm(q + attended)
        q_vec = (q * q_mask.unsqueeze(-1)).sum(1) / q_mask.sum(1, keepdim=True)
        h = torch.cat([q_vec, img[:, 0]], dim=-1)
        logits = self.answer_head(h)
        count_logits = None
        if count_mask is not None and count_mask.any():
            count_logits = self.count_head(h[count_mask])
        return logits, count_logits


def vqa_score(pred, gts):
    return sum(min(1.0, sum(g == pred for j, g in enumerate(gts) if j != i) / 3) for i in range(len(gts))) / len(gts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--answers", default="answers_3129.json")
    ap.add_argument("--out", default="runs/vitl_vqa")
    ap.add_argument("--batch_size", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--count_weight", type=float, default=0.5)
    ap.add_argument("--grad_ckpt", action="store_true")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    answer_list = json.load(open(args.answers))
    ans2idx = {a: i for i, a in enumerate(answer_list)}
    norm = transforms.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
    train_set = VQA(args.data, "train", ans2idx, transforms.Compose(
        [transforms.Resize((384, 384)), transforms.ColorJitter(0.2, 0.2), transforms.ToTensor(), norm]))
    val_set = VQA(args.data, "val", ans2idx, transforms.Compose(
        [transforms.Resize((384, 384)), transforms.ToTensor(), norm]))
    val_rows = {r[0]: r for r in val_set.rows}
    sampler = DistributedSampler(train_set, shuffle=True)
    loader = DataLoader(train_set, args.batch_size, sampler=sampler, num_workers=10, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, 96, sampler=DistributedSampler(val_set, shuffle=False), num_workers=10)

    tok = BertTokenizerFast.from_pretrained("bert-large-uncased")
    model = VQAModel(len(answer_list), grad_ckpt=args.grad_ckpt).to(device)
    # the count head only sees batches that contain a countable "number" question
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    total = len(loader) * args.epochs
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(0.05 * total), total)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for it, (images, questions, target, count, _) in enumerate(loader):
            q = tok(list(questions), padding=True, truncation=True, max_length=32, return_tensors="pt").to(device)
            images, target, count = images.to(device, non_blocking=True), target.to(device), count.to(device)
            count_mask = count >= 0
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits, count_logits = model(images, q.input_ids, q.attention_mask, count_mask)
            loss = F.binary_cross_entropy_with_logits(logits.float(), target) * target.size(1)
            if count_logits is not None:
                loss = loss + args.count_weight * F.cross_entropy(count_logits.float(), count[count_mask])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            if it % 100 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"epoch {epoch} it {it}/{len(loader)} loss {l.item():.4f}", flush=True)

        model.eval()
        local = []
        with torch.no_grad():
            for images, questions, _, _, qids in val_loader:
                q = tok(list(questions), padding=True, truncation=True, max_length=32, return_tensors="pt").to(device)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits, _ = model.module(images.to(device), q.input_ids, q.attention_mask)
                local += list(zip(qids.tolist(), logits.argmax(-1).tolist()))
        parts = [None] * world
        dist.all_gather_object(parts, local)
        if rank == 0:
            preds = dict(p for part in parts for p in part)
            per_at, per_qt, allv = defaultdict(list), defaultdict(list), []
            for qid, p in preds.items():
                _, _, _, gts, _, at, qt = val_rows[qid]
                s = vqa_score(answer_list[p], gts)
                allv.append(s)
                per_at[at].append(s)
                per_qt[qt].append(s)
            res = {"overall": 100 * sum(allv) / len(allv), **{k: 100 * sum(v) / len(v) for k, v in per_at.items()}}
            print(f"epoch {epoch} val {json.dumps(res)}", flush=True)
            json.dump({k: 100 * sum(v) / len(v) for k, v in sorted(per_qt.items())},
                      open(os.path.join(args.out, f"qtype_{epoch}.json"), "w"), indent=1)
            torch.save({"model": model.module.state_dict(), "epoch": epoch}, os.path.join(args.out, "last.pt"))
            if res["overall"] > best:
                best = res["overall"]
                torch.save({"model": model.module.state_dict(), "epoch": epoch}, os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
