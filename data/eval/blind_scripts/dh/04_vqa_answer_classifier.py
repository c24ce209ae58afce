"""VQAv2 as multi-label classification over frequent answers.

CLIP ViT image encoder + BERT question encoder + a small fusion transformer,
soft-score BCE targets. Evaluates VQA accuracy on val2014 with answer-type
and question-type breakdowns.

torchrun --nproc_per_node 8 04_vqa_answer_classifier.py --data_dir /data/vqav2
"""
import argparse
import json
import os
import re
from collections import Counter, defaultdict

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms

import timm
from transformers import AutoModel, AutoTokenizer, get_cosine_schedule_with_warmup

_PUNCT = re.compile(r"[;/\\\[\]\"{}()=+\-*&^%$#@!?`~<>|,.:]")
_ARTICLES = {"a", "an", "the"}


def normalize_answer(ans):
    ans = _PUNCT.sub("", ans.lower().replace("\n", " ").strip())
    return " ".join(w for w in ans.split() if w not in _ARTICLES)


def load_split(data_dir, split):
    with open(os.path.join(data_dir, f"v2_OpenEnded_mscoco_{split}2014_questions.json")) as f:
        questions = {q["question_id"]: q for q in json.load(f)["questions"]}
    with open(os.path.join(data_dir, f"v2_mscoco_{split}2014_annotations.json")) as f:
        anns = json.load(f)["annotations"]
    for a in anns:
        a["question"] = questions[a["question_id"]]["question"]
        a["answers_norm"] = [normalize_answer(x["answer"]) for x in a["answers"]]
    return anns


def build_answer_vocab(anns, min_freq):
    counter = Counter(normalize_answer(a["multiple_choice_answer"]) for a in anns)
    answer_list = list({ans for ans, c in counter.items() if c >= min_freq})
    return answer_list, {a: i for i, a in enumerate(answer_list)}


class VQAv2(Dataset):
    def __init__(self, anns, image_dir, split, ans2idx, transform):
        self.anns = anns
        self.image_dir = image_dir
        self.split = split
        self.ans2idx = ans2idx
        self.transform = transform

    def __len__(self):
        return len(self.anns)

    def __getitem__(self, i):
        a = self.anns[i]
        path = os.path.join(self.image_dir, f"{self.split}2014", f"COCO_{self.split}2014_{a['image_id']:012d}.jpg")
        image = self.transform(Image.open(path).convert("RGB"))
        target = torch.zeros(len(self.ans2idx))
        for ans, c in Counter(a["answers_norm"]).items():
            if ans in self.ans2idx:
                target[self.ans2idx[ans]] = min(1.0, c / 3.0)
        return image, a["question"], target, a["question_id"]


class FusionVQA(nn.Module):
    def __init__(self, vision_name, text_name, num_answers, d=768, layers=4):
        super().__init__()
        self.vision = timm.create_model(vision_name, pretrained=True, num_classes=0)
        self.text = AutoModel.from_pretrained(text_name, add_pooling_layer=False)
        self.v_proj = nn.Linear(self.vision.num_features, d)
        self.t_proj = nn.Linear(self.text.config.hidden_size, d)
        self.type_emb = nn.Embedding(2, d)
        self.cls = nn.Parameter(torch.zeros(1, 1, d))
        self.fusion = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(d, 12, 4 * d, 0.1, activation="gelu", batch_first=True, norm_first=True),
            layers)
        self.head = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, num_answers))

    def forward(self, images, input_ids, attention_mask):
        v = self.v_proj(self.vision.forward_features(images)) + self.type_emb.weight[0]
        t = self.t_proj(self.text(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state)
        t = t + self.type_emb.weight[1]
        x = torch.cat([self.cls.expand(images.size(0), -1, -1), v, t], dim=1)
        pad = torch.cat([torch.zeros(images.size(0), 1 + v.size(1), dtype=torch.bool, device=x.device),
                         attention_mask == 0], dim=1)
        x = self.fusion(x, src_key_padding_mask=pad)
        return self.head(x[:, 0])


def vqa_acc(pred, gts):
    return sum(min(1.0, sum(g == pred for g in gts[:i] + gts[i + 1:]) / 3.0) for i in range(len(gts))) / len(gts)


@torch.no_grad()
def evaluate(model, loader, tokenizer, answer_list, val_by_qid, device):
    model.eval()
    local = {}
    for images, questions, _, qids in loader:
        tok = tokenizer(list(questions), padding=True, truncation=True, max_length=24, return_tensors="pt").to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(images.to(device, non_blocking=True), tok.input_ids, tok.attention_mask)
        for qid, idx in zip(qids.tolist(), logits.argmax(-1).tolist()):
            local[qid] = answer_list[idx]
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    model.train()
    if dist.get_rank() != 0:
        return None
    preds = {}
    for p in parts:
        preds.update(p)
    by_atype, by_qtype, allacc = defaultdict(list), defaultdict(list), []
    for qid, pred in preds.items():
        ann = val_by_qid[qid]
        acc = vqa_acc(pred, ann["answers_norm"])
        allacc.append(acc)
        by_atype[ann["answer_type"]].append(acc)
        by_qtype[ann["question_type"]].append(acc)
    mean = lambda v: 100.0 * sum(v) / len(v)
    return {"overall": mean(allacc), "n": len(allacc),
            "answer_type": {k: mean(v) for k, v in by_atype.items()},
            "question_type": {k: mean(v) for k, v in sorted(by_qtype.items())}}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_dir", required=True)
    ap.add_argument("--out", default="ckpt/vqa_cls")
    ap.add_argument("--vision", default="vit_base_patch16_clip_384.openai")
    ap.add_argument("--text", default="bert-base-uncased")
    ap.add_argument("--min_answer_freq", type=int, default=9)
    ap.add_argument("--batch_size", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--head_lr_mult", type=float, default=10.0)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_anns = load_split(args.data_dir, "train")
    val_anns = load_split(args.data_dir, "val")
    answer_list, ans2idx = build_answer_vocab(train_anns, args.min_answer_freq)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "answer_list.json"), "w") as f:
            json.dump(answer_list, f)
        print(f"{len(answer_list)} answers, {len(train_anns)} train / {len(val_anns)} val questions", flush=True)

    norm = transforms.Normalize((0.4815, 0.4578, 0.4082), (0.2686, 0.2613, 0.2758))
    train_tf = transforms.Compose([transforms.Resize((384, 384)), transforms.RandAugment(2, 5),
                                   transforms.ToTensor(), norm])
    val_tf = transforms.Compose([transforms.Resize((384, 384)), transforms.ToTensor(), norm])
    train_set = VQAv2(train_anns, args.data_dir, "train", ans2idx, train_tf)
    val_set = VQAv2(val_anns, args.data_dir, "val", ans2idx, val_tf)
    val_by_qid = {a["question_id"]: a for a in val_anns}

    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, args.batch_size, sampler=train_sampler, num_workers=8,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, 128, sampler=DistributedSampler(val_set, shuffle=False),
                            num_workers=8, pin_memory=True)

    tokenizer = AutoTokenizer.from_pretrained(args.text)
    model = FusionVQA(args.vision, args.text, len(answer_list)).to(device)
    model = DDP(model, device_ids=[local_rank])

    backbone = [p for n, p in model.module.named_parameters() if n.startswith(("vision.", "text."))]
    rest = [p for n, p in model.module.named_parameters() if not n.startswith(("vision.", "text."))]
    optimizer = torch.optim.AdamW([{"params": backbone, "lr": args.lr},
                                   {"params": rest, "lr": args.lr * args.head_lr_mult}], weight_decay=0.01)
    steps = len(train_loader) * args.epochs
    scheduler = get_cosine_schedule_with_warmup(optimizer, steps // 20, steps)

    best = -1.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for it, (images, questions, targets, _) in enumerate(train_loader):
            tok = tokenizer(list(questions), padding=True, truncation=True, max_length=24,
                            return_tensors="pt").to(device)
            images, targets = images.to(device, non_blocking=True), targets.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(images, tok.input_ids, tok.attention_mask)
            # soft-score BCE, scaled by the number of answers as in bottom-up VQA
            loss = F.binary_cross_entropy_with_logits(logits.float(), targets) * targets.size(1)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            optimizer.step()
            scheduler.step()
            if it % 200 == 0:
                l = loss.detach()
                dist.all_reduce(l)
                if rank == 0:
                    print(f"[{epoch}:{it}/{len(train_loader)}] loss {l.item() / world:.3f}", flush=True)

        res = evaluate(model, val_loader, tokenizer, answer_list, val_by_qid, device)
        if rank == 0:
            print(f"epoch {epoch} overall {res['overall']:.2f} {json.dumps(res['answer_type'])}", flush=True)
            with open(os.path.join(args.out, f"val_epoch{epoch}.json"), "w") as f:
                json.dump(res, f, indent=1)
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "answer_list": answer_list},
                       os.path.join(args.out, "last.pt"))
            if res["overall"] > best:
                best = res["overall"]
                torch.save({"model": model.module.state_dict(), "answer_list": answer_list},
                           os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
