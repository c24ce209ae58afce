"""R2GenGPT-style report generation: frozen Swin-B visual tokens -> trainable projector ->
Llama-2-7B with LoRA adapters.  Clinical efficacy is measured with the CheXbert labeler
on every rank's validation shard; TP/FP/FN counts are all-reduced.

    torchrun --nproc_per_node=8 18_swin_llama_lora.py --llm meta-llama/Llama-2-7b-chat-hf \
        --chexbert-ckpt weights/chexbert.pth
"""
import argparse
import os

import pandas as pd
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
from peft import LoraConfig, get_peft_model
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms
from transformers import AutoModelForCausalLM, AutoTokenizer, BertConfig, BertModel, BertTokenizer

PROMPT = "Human: <Img><ImageHere></Img> Generate a comprehensive and detailed diagnosis report for this chest xray image. \nAssistant:"
CONDITIONS = ["Enlarged Cardiomediastinum", "Cardiomegaly", "Lung Opacity", "Lung Lesion", "Edema",
              "Consolidation", "Pneumonia", "Atelectasis", "Pneumothorax", "Pleural Effusion",
              "Pleural Other", "Fracture", "Support Devices", "No Finding"]


class CheXbertLabeler(nn.Module):
    """Stanford CheXbert: BERT-base with 13 four-way heads and one two-way head (No Finding)."""

    def __init__(self, ckpt_path, device="cuda:0"):
        super().__init__()
        self.device = device
        self.tokenizer = BertTokenizer.from_pretrained("bert-base-uncased")
        self.bert = BertModel(BertConfig.from_pretrained("bert-base-uncased"))
        hidden = self.bert.config.hidden_size
        self.linear_heads = nn.ModuleList([nn.Linear(hidden, 4) for _ in range(13)] + [nn.Linear(hidden, 2)])
        state = torch.load(ckpt_path, map_location="cpu")["model_state_dict"]
        self.load_state_dict({k.replace("module.", ""): v for k, v in state.items()}, strict=False)
        self.eval().to(device)

    @torch.no_grad()
    def positives(self, reports):
        enc = self.tokenizer(reports, padding=True, truncation=True, max_length=512, return_tensors="pt").to(self.device)
        cls = self.bert(**enc).last_hidden_state[:, 0]
        preds = torch.stack([head(cls).argmax(-1) for head in self.linear_heads], 1)
        return (preds == 1) | (preds == 3)          # positive or uncertain counts as positive


class ReportSet(Dataset):
    def __init__(self, csv, root, train):
        self.df = pd.read_csv(csv)
        self.root = root
        self.tf = transforms.Compose([
            transforms.Resize((224, 224)),
            *([transforms.RandomRotation(5)] if train else []),
            transforms.ToTensor(), transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])

    def __len__(self):
        return len(self.df)

    def __getitem__(self, i):
        r = self.df.iloc[i]
        return self.tf(Image.open(os.path.join(self.root, r.image)).convert("RGB")), r.report


class R2GenLlama(nn.Module):
    def __init__(self, llm_name, lora_r):
        super().__init__()
        self.visual = timm.create_model("swin_base_patch4_window7_224.ms_in22k", pretrained=True, num_classes=0)
        self.visual.requires_grad_(False)
        llm = AutoModelForCausalLM.from_pretrained(llm_name, torch_dtype=torch.bfloat16)
        llm.requires_grad_(False)
        self.llm = get_peft_model(llm, LoraConfig(r=lora_r, lora_alpha=2 * lora_r, lora_dropout=0.1,
                                                  target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
        self.proj = nn.Sequential(nn.Linear(self.visual.num_features, llm.config.hidden_size),
                                  nn.LayerNorm(llm.config.hidden_size))

    def embed(self, ids):
        return self.llm.get_input_embeddings()(ids)

    def prefix_embeds(self, images, tok):
        with torch.no_grad():
            v = self.visual.forward_features(images).flatten(1, 2)
        img = self.proj(v).to(torch.bfloat16)
        pre, post = PROMPT.split("<ImageHere>")
        B = images.size(0)
        ids_pre = tok(pre, return_tensors="pt").input_ids.to(images.device).expand(B, -1)
        ids_post = tok(post, return_tensors="pt", add_special_tokens=False).input_ids.to(images.device).expand(B, -1)
        return torch.cat([self.embed(ids_pre), img, self.embed(ids_post)], 1)

    def forward(self, images, tgt_ids, tgt_mask, tok):
        prefix = self.prefix_embeds(images, tok)
        embeds = torch.cat([prefix, self.embed(tgt_ids)], 1)
        mask = torch.cat([tgt_mask.new_ones(prefix.shape[:2]), tgt_mask], 1)
        labels = torch.cat([tgt_ids.new_full(prefix.shape[:2], -100), tgt_ids.masked_fill(tgt_mask == 0, -100)], 1)
        return self.llm(inputs_embeds=embeds, attention_mask=mask, labels=labels).loss

    @torch.no_grad()
    def generate(self, images, tok, max_new_tokens):
        prefix = self.prefix_embeds(images, tok)
        return self.llm.generate(inputs_embeds=prefix, max_new_tokens=max_new_tokens, num_beams=3,
                                 do_sample=False, repetition_penalty=2.0, pad_token_id=tok.pad_token_id)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-csv", default="data/mimic/train.csv")
    ap.add_argument("--val-csv", default="data/mimic/val.csv")
    ap.add_argument("--image-root", default="data/mimic/images")
    ap.add_argument("--llm", default="meta-llama/Llama-2-7b-chat-hf")
    ap.add_argument("--chexbert-ckpt", default="weights/chexbert.pth")
    ap.add_argument("--out", default="save/r2gen_llama")
    ap.add_argument("--lora-r", type=int, default=16)
    ap.add_argument("--bs", type=int, default=6)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--max-new-tokens", type=int, default=100)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    tok = AutoTokenizer.from_pretrained(args.llm, use_fast=False)
    tok.pad_token_id = 0
    tok.padding_side = "right"
    train_ds = ReportSet(args.train_csv, args.image_root, True)
    val_ds = ReportSet(args.val_csv, args.image_root, False)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, args.bs, sampler=sampler, num_workers=6, pin_memory=True, drop_last=True)
    val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), args.bs * 2, num_workers=6)

    model = R2GenLlama(args.llm, args.lora_r).to(device)
    model = DDP(model, device_ids=[local_rank])
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.epochs * len(train_dl), eta_min=1e-6)
    labeler = CheXbertLabeler(args.chexbert_ckpt)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        n_train = sum(p.numel() for p in trainable)
        print(f"trainable params {n_train / 1e6:.1f}M, world {world}", flush=True)

    best = -1.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for step, (images, reports) in enumerate(train_dl):
            tgt = tok([r + tok.eos_token for r in reports], padding="longest", truncation=True,
                      max_length=args.max_new_tokens, return_tensors="pt", add_special_tokens=False)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(images.to(device, non_blocking=True), tgt.input_ids.to(device),
                             tgt.attention_mask.to(device), tok)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if rank == 0 and step % 50 == 0:
                print(f"epoch {epoch} step {step}/{len(train_dl)} loss {loss.item():.4f}", flush=True)

        model.eval()
        counts = torch.zeros(3, len(CONDITIONS), device=device)   # tp, fp, fn
        for images, reports in val_dl:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model.module.generate(images.to(device), tok, args.max_new_tokens)
            hyps = [h.strip() for h in tok.batch_decode(out, skip_special_tokens=True)]
            hp = labeler.positives(hyps).to(device)
            rp = labeler.positives(list(reports)).to(device)
            counts[0] += (hp & rp).sum(0)
            counts[1] += (hp & ~rp).sum(0)
            counts[2] += (~hp & rp).sum(0)
        dist.all_reduce(counts)
        tp, fp, fn = counts.sum(1)
        micro_f1 = (2 * tp / (2 * tp + fp + fn).clamp(min=1)).item()

        if rank == 0:
            print(f"epoch {epoch} CheXbert micro-F1 (14) {micro_f1:.4f}", flush=True)
            trainable_sd = {k: v for k, v in model.module.state_dict().items()
                            if k.startswith("proj.") or "lora_" in k}
            torch.save({"state": trainable_sd, "epoch": epoch, "f1": micro_f1},
                       os.path.join(args.out, f"epoch{epoch}.pt"))
            if micro_f1 > best:
                best = micro_f1
                torch.save({"state": trainable_sd, "epoch": epoch, "f1": micro_f1}, os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
