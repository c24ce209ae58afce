"""Generative VQA (VL-BART style): [question tokens ; CLIP patch features] go into
the BART encoder, the decoder generates the answer. Each question keeps all ten
human answers; one is drawn per visit, weighted by how many annotators gave it.

torchrun --nproc_per_node=8 19_clip_bart_genvqa.py --vqa /data/vqav2 --coco /data/coco
"""
import argparse
import json
import os
import random
import re
from collections import Counter, defaultdict

import torch
import torch.distributed as dist
import torch.nn as nn
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from transformers import (BartForConditionalGeneration, BartTokenizerFast, CLIPImageProcessor,
                          CLIPVisionModel, get_linear_schedule_with_warmup)

_punct = re.compile(r"(?!<=\d)(\.)(?!\d)|[;/\[\]\"{}()=+\\_\-><@`,?!*#%^&$]")


def norm_ans(a):
    a = _punct.sub("", a.lower().strip())
    return " ".join(w for w in a.split() if w not in ("a", "an", "the"))


class VQAv2Gen(Dataset):
    def __init__(self, vqa, coco, split, train):
        qs = json.load(open(f"{vqa}/v2_OpenEnded_mscoco_{split}2014_questions.json"))["questions"]
        anns = json.load(open(f"{vqa}/v2_mscoco_{split}2014_annotations.json"))["annotations"]
        anns = {a["question_id"]: a for a in anns}
        self.items = []
        for q in qs:
            a = anns[q["question_id"]]
            self.items.append(dict(qid=q["question_id"], question=q["question"],
                                   image=f"{coco}/{split}2014/COCO_{split}2014_{q['image_id']:012d}.jpg",
                                   answers=[norm_ans(x["answer"]) for x in a["answers"]],
                                   answer_type=a["answer_type"], question_type=a["question_type"]))
        self.train = train

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        it = self.items[i]
        image = Image.open(it["image"]).convert("RGB")
        if self.train:
            c = Counter(it["answers"])
            answer = random.choices(list(c), weights=list(c.values()), k=1)[0]
            return image, it["question"], answer
        return image, it["question"], it["qid"]


class ClipBart(nn.Module):
    def __init__(self, clip="openai/clip-vit-base-patch16", bart="facebook/bart-base"):
        super().__init__()
        self.vision = CLIPVisionModel.from_pretrained(clip)
        self.bart = BartForConditionalGeneration.from_pretrained(bart)
        d = self.bart.config.d_model
        self.visual_proj = nn.Sequential(nn.Linear(self.vision.config.hidden_size, d), nn.LayerNorm(d))
        self.vis_type = nn.Parameter(torch.zeros(1, 1, d))

    def encoder_inputs(self, pixel_values, q_ids, q_mask):
        v = self.vision(pixel_values=pixel_values).last_hidden_state
        v = self.vision.vision_model.post_layernorm(v)  # CLIP only norms the pooled token; norm every patch
        v = self.visual_proj(v) + self.vis_type
        t = self.bart.get_input_embeddings()(q_ids)
        embeds = torch.cat([t, v], 1)
        mask = torch.cat([q_mask, torch.ones(v.shape[:2], dtype=q_mask.dtype, device=q_mask.device)], 1)
        return embeds, mask

    def forward(self, pixel_values, q_ids, q_mask, labels):
        embeds, mask = self.encoder_inputs(pixel_values, q_ids, q_mask)
        return self.bart(inputs_embeds=embeds, attention_mask=mask, labels=labels).loss

    @torch.no_grad()
    def answer(self, pixel_values, q_ids, q_mask, max_new_tokens=10):
        embeds, mask = self.encoder_inputs(pixel_values, q_ids, q_mask)
        return self.bart.generate(inputs_embeds=embeds, attention_mask=mask, num_beams=1,
                                  max_new_tokens=max_new_tokens)


def vqa_accuracy(pred, answers):
    return sum(min(1.0, sum(a == pred for j, a in enumerate(answers) if j != i) / 3.0)
               for i in range(len(answers))) / len(answers)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vqa", required=True)
    ap.add_argument("--coco", required=True)
    ap.add_argument("--output", default="checkpoints/clip_bart_vqa")
    ap.add_argument("--per_device_batch", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--vision_lr", type=float, default=1e-5)
    ap.add_argument("--warmup_ratio", type=float, default=0.05)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    img_proc = CLIPImageProcessor.from_pretrained("openai/clip-vit-base-patch16")
    tok = BartTokenizerFast.from_pretrained("facebook/bart-base")

    def collate_train(batch):
        images, questions, answers = zip(*batch)
        pv = img_proc(images=list(images), return_tensors="pt").pixel_values
        q = tok([f"vqa: {x}" for x in questions], padding=True, truncation=True, max_length=32, return_tensors="pt")
        a = tok(list(answers), padding=True, truncation=True, max_length=10, return_tensors="pt")
        labels = a.input_ids.masked_fill(a.attention_mask == 0, -100)
        return pv, q.input_ids, q.attention_mask, labels

    def collate_eval(batch):
        images, questions, qids = zip(*batch)
        pv = img_proc(images=list(images), return_tensors="pt").pixel_values
        q = tok([f"vqa: {x}" for x in questions], padding=True, truncation=True, max_length=32, return_tensors="pt")
        return pv, q.input_ids, q.attention_mask, torch.tensor(qids)

    train_set = VQAv2Gen(args.vqa, args.coco, "train", train=True)
    val_set = VQAv2Gen(args.vqa, args.coco, "val", train=False)
    val_items = {it["qid"]: it for it in val_set.items}
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=1)
    train_loader = DataLoader(train_set, batch_size=args.per_device_batch, sampler=train_sampler,
                              num_workers=8, collate_fn=collate_train, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=128, sampler=DistributedSampler(val_set, shuffle=False),
                            num_workers=8, collate_fn=collate_eval, pin_memory=True)

    model = ClipBart().to(device)
    model = DDP(model, device_ids=[local_rank])
    vis = [p for n, p in model.module.named_parameters() if n.startswith("vision.")]
    other = [p for n, p in model.module.named_parameters() if not n.startswith("vision.")]
    optimizer = torch.optim.AdamW([{"params": vis, "lr": args.vision_lr}, {"params": other, "lr": args.lr}],
                                  weight_decay=0.01)
    total = len(train_loader) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(args.warmup_ratio * total), total)

    best = 0.0
    for epoch in range(args.epochs):
        model.train()
        run = torch.zeros(2, device=device)
        for step, (pv, q_ids, q_mask, labels) in enumerate(train_loader):
            pv, q_ids, q_mask, labels = pv.to(device), q_ids.to(device), q_mask.to(device), labels.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(pv, q_ids, q_mask, labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            run[0] += loss.detach()
            run[1] += 1
            if (step + 1) % 200 == 0:
                dist.all_reduce(run)
                if rank == 0:
                    print(f"epoch {epoch} step {step + 1}/{len(train_loader)} loss {(run[0] / run[1]).item():.4f}",
                          flush=True)
                run.zero_()

        model.eval()
        local = []
        for pv, q_ids, q_mask, qids in val_loader:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model.module.answer(pv.to(device), q_ids.to(device), q_mask.to(device))
            local += list(zip(qids.tolist(), [norm_ans(s) for s in tok.batch_decode(out, skip_special_tokens=True)]))
        gathered = [None] * world
        dist.all_gather_object(gathered, local)
        if rank == 0:
            preds = dict(x for g in gathered for x in g)
            acc, by_a, by_q = [], defaultdict(list), defaultdict(list)
            for qid, p in preds.items():
                it = val_items[qid]
                s = vqa_accuracy(p, it["answers"])
                acc.append(s)
                by_a[it["answer_type"]].append(s)
                by_q[it["question_type"]].append(s)
            summary = {"overall": 100 * sum(acc) / len(acc), **{k: 100 * sum(v) / len(v) for k, v in by_a.items()}}
            print(f"epoch {epoch}: " + " ".join(f"{k}={v:.2f}" for k, v in summary.items()), flush=True)
            os.makedirs(args.output, exist_ok=True)
            with open(os.path.join(args.output, f"val_epoch{epoch}.json"), "w") as f:
                json.dump({"summary": summary,
                           "question_type": {k: 100 * sum(v) / len(v) for k, v in sorted(by_q.items())}}, f, indent=1)
            if summary["overall"] > best:
                best = summary["overall"]
                torch.save(model.module.state_dict(), os.path.join(args.output, "best.pt"))
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch}, os.path.join(args.output, "last.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
