"""Open-ended VQA as generation: CLIP ViT patch tokens -> prefix of a GPT-2 LM.

Sequence:  [image prefix] "question: <q> answer:" " <a><eos>"
Only the answer tokens are supervised.

torchrun --nproc_per_node=8 09_prefix_gpt2_vqa.py --vqa_dir /data/vqav2 --coco_dir /data/coco
"""
import argparse
import json
import os
import random
from collections import Counter, defaultdict

import torch
import torch.distributed as dist
import torch.nn as nn
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms

import timm
from transformers import GPT2LMHeadModel, GPT2TokenizerFast, get_cosine_schedule_with_warmup


def load_vqa(vqa_dir, split):
    qs = json.load(open(f"{vqa_dir}/v2_OpenEnded_mscoco_{split}2014_questions.json"))["questions"]
    anns = {a["question_id"]: a for a in json.load(open(f"{vqa_dir}/v2_mscoco_{split}2014_annotations.json"))["annotations"]}
    out = []
    for q in qs:
        a = anns[q["question_id"]]
        out.append({"qid": q["question_id"], "image_id": q["image_id"], "question": q["question"],
                    "answers": [x["answer"] for x in a["answers"]],
                    "answer_type": a["answer_type"], "question_type": a["question_type"]})
    return out


class VQAGen(Dataset):
    def __init__(self, records, coco_dir, split, tf, train):
        self.records, self.coco_dir, self.split, self.tf, self.train = records, coco_dir, split, tf, train

    def __len__(self):
        return len(self.records)

    def __getitem__(self, i):
        r = self.records[i]
        img = Image.open(f"{self.coco_dir}/{self.split}2014/COCO_{self.split}2014_{r['image_id']:012d}.jpg")
        prompt = f"question: {r['question'].strip()} answer:"
        if self.train:
            counts = Counter(r["answers"])
            ans = random.choices(list(counts), weights=list(counts.values()))[0]
            return self.tf(img.convert("RGB")), prompt, " " + ans
        return self.tf(img.convert("RGB")), prompt, r["qid"]


class PrefixVQA(nn.Module):
    def __init__(self, vit="vit_base_patch16_clip_224.openai", lm="gpt2-medium"):
        super().__init__()
        self.vit = timm.create_model(vit, pretrained=True, num_classes=0)
        self.lm = GPT2LMHeadModel.from_pretrained(lm)
        d = self.lm.config.n_embd
        self.prefix = nn.Sequential(nn.Linear(self.vit.num_features, d), nn.GELU(), nn.Linear(d, d))

    def embed(self, pixel_values, ids):
        return torch.cat([self.prefix(self.vit.forward_features(pixel_values)), self.lm.transformer.wte(ids)], 1)

    def forward(self, pixel_values, ids, attn, labels):
        x = self.embed(pixel_values, ids)
        P = x.size(1) - ids.size(1)
        ones = torch.ones(ids.size(0), P, dtype=attn.dtype, device=attn.device)
        ignore = torch.full((ids.size(0), P), -100, dtype=labels.dtype, device=labels.device)
        return self.lm(inputs_embeds=x, attention_mask=torch.cat([ones, attn], 1),
                       labels=torch.cat([ignore, labels], 1)).loss

    @torch.no_grad()
    def generate(self, pixel_values, ids, attn, eos_id, max_new_tokens=8):
        # ids are left padded; positions count only real tokens
        x = self.embed(pixel_values, ids)
        P = x.size(1) - ids.size(1)
        mask = torch.cat([torch.ones(ids.size(0), P, dtype=attn.dtype, device=attn.device), attn], 1)
        pos = (mask.cumsum(1) - 1).clamp(min=0)
        out = self.lm(inputs_embeds=x, attention_mask=mask, position_ids=pos, use_cache=True)
        past, generated = out.past_key_values, []
        nxt = out.logits[:, -1].argmax(-1)
        done = torch.zeros_like(nxt, dtype=torch.bool)
        for _ in range(max_new_tokens):
            generated.append(nxt)
            done |= nxt == eos_id
            if done.all():
                break
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            pos = pos[:, -1:] + 1
            out = self.lm(input_ids=nxt[:, None], attention_mask=mask, position_ids=pos,
                          past_key_values=past, use_cache=True)
            past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1)
        return torch.stack(generated, 1)


def vqa_acc(pred, answers):
    pred = pred.strip().lower()
    return sum(min(1.0, sum(a == pred for j, a in enumerate(answers) if j != i) / 3.0)
               for i in range(len(answers))) / len(answers)


@torch.no_grad()
def evaluate(model, loader, tok, val_by_qid, device):
    model.eval()
    local = []
    for images, prompts, qids in loader:
        enc = tok(list(prompts), padding=True, return_tensors="pt").to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model.generate(images.to(device), enc.input_ids, enc.attention_mask, tok.eos_token_id)
        for qid, seq in zip(qids.tolist(), out.tolist()):
            local.append((qid, tok.decode(seq, skip_special_tokens=True)))
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    model.train()
    if dist.get_rank() != 0:
        return None
    preds = dict(x for p in parts for x in p)
    acc_all, acc_at, acc_qt = [], defaultdict(list), defaultdict(list)
    for qid, pred in preds.items():
        r = val_by_qid[qid]
        a = vqa_acc(pred, r["answers"])
        acc_all.append(a)
        acc_at[r["answer_type"]].append(a)
        acc_qt[r["question_type"]].append(a)
    avg = lambda v: round(100 * sum(v) / len(v), 2)
    return {"overall": avg(acc_all), **{k: avg(v) for k, v in acc_at.items()},
            "per_question_type": {k: avg(v) for k, v in sorted(acc_qt.items())}}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vqa_dir", required=True)
    ap.add_argument("--coco_dir", required=True)
    ap.add_argument("--out_dir", default="ckpt/prefix_vqa")
    ap.add_argument("--batch_size", type=int, default=48, help="per GPU; 8 GPUs -> 384")
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--max_len", type=int, default=40)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    device = torch.device(f"cuda:{local_rank}")

    tok = GPT2TokenizerFast.from_pretrained("gpt2-medium")
    tok.pad_token = tok.eos_token
    tok.padding_side = "left"

    norm = transforms.Normalize((0.4815, 0.4578, 0.4082), (0.2686, 0.2613, 0.2758))
    tf_train = transforms.Compose([transforms.RandomResizedCrop(224, scale=(0.8, 1.0)), transforms.ToTensor(), norm])
    tf_val = transforms.Compose([transforms.Resize(224), transforms.CenterCrop(224), transforms.ToTensor(), norm])
    train_records = load_vqa(args.vqa_dir, "train")
    val_records = load_vqa(args.vqa_dir, "val")
    train_set = VQAGen(train_records, args.coco_dir, "train", tf_train, train=True)
    val_set = VQAGen(val_records, args.coco_dir, "val", tf_val, train=False)
    val_by_qid = {r["qid"]: r for r in val_records}

    def train_collate(batch):
        images, prompts, answers = zip(*batch)
        p = tok(list(prompts), add_special_tokens=False).input_ids
        a = tok([x + tok.eos_token for x in answers], add_special_tokens=False).input_ids
        L = min(args.max_len, max(len(x) + len(y) for x, y in zip(p, a)))
        ids = torch.full((len(batch), L), tok.pad_token_id, dtype=torch.long)
        attn = torch.zeros(len(batch), L, dtype=torch.long)
        labels = torch.full((len(batch), L), -100, dtype=torch.long)
        for i, (x, y) in enumerate(zip(p, a)):
            seq = (x + y)[:L]
            ids[i, :len(seq)] = torch.tensor(seq)
            attn[i, :len(seq)] = 1
            labels[i, len(x):len(seq)] = ids[i, len(x):len(seq)]
        return torch.stack(images), ids, attn, labels

    sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=8,
                              collate_fn=train_collate, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=128, sampler=DistributedSampler(val_set, shuffle=False),
                            num_workers=8, pin_memory=True)

    model = DDP(PrefixVQA().to(device), device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = args.epochs * len(train_loader)
    scheduler = get_cosine_schedule_with_warmup(optimizer, 1000, total)

    os.makedirs(args.out_dir, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for it, (images, ids, attn, labels) in enumerate(train_loader):
            images, ids, attn, labels = (t.to(device, non_blocking=True) for t in (images, ids, attn, labels))
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(images, ids, attn, labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            if it % 100 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"epoch {epoch} it {it}/{len(train_loader)} loss {l.item():.4f}", flush=True)

        res = evaluate(model, val_loader, tok, val_by_qid, device)
        if rank == 0:
            print(f"epoch {epoch}: {json.dumps({k: v for k, v in res.items() if k != 'per_question_type'})}")
            json.dump(res, open(os.path.join(args.out_dir, f"eval_{epoch}.json"), "w"), indent=1)
            torch.save(model.module.state_dict(), os.path.join(args.out_dir, "last.pt"))
            if res["overall"] > best:
                best = res["overall"]
                torch.save(model.module.state_dict(), os.path.join(args.out_dir, "best.pt"))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
