#!/usr/bin/env python
"""Text-to-image LoRA for SD 1.5 with HF Accelerate, EMA of the LoRA weights and a CLIP-score eval.

accelerate launch --multi_gpu --num_processes 8 --mixed_precision bf16 \
    04_accelerate_lora_clipscore.py --dataset_name lambdalabs/naruto-blip-captions --output_dir out/naruto-lora
"""
import argparse
import logging
import math
import os

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import ProjectConfiguration, gather_object, set_seed
from datasets import load_dataset
from torchvision import transforms
from tqdm.auto import tqdm

from diffusers import AutoencoderKL, DDPMScheduler, StableDiffusionPipeline, UNet2DConditionModel
from diffusers.optimization import get_scheduler
from diffusers.training_utils import EMAModel, cast_training_params
from diffusers.utils import convert_state_dict_to_diffusers
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict
from transformers import CLIPModel, CLIPProcessor, CLIPTextModel, CLIPTokenizer

logger = get_logger(__name__, log_level="INFO")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--pretrained_model", default="runwayml/stable-diffusion-v1-5")
    p.add_argument("--dataset_name", default="lambdalabs/naruto-blip-captions")
    p.add_argument("--output_dir", default="out/lora")
    p.add_argument("--resolution", type=int, default=512)
    p.add_argument("--train_batch_size", type=int, default=4)
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--max_train_steps", type=int, default=15000)
    p.add_argument("--learning_rate", type=float, default=1e-4)
    p.add_argument("--scale_lr", action="store_true")
    p.add_argument("--lr_warmup_steps", type=int, default=500)
    p.add_argument("--rank", type=int, default=4)
    p.add_argument("--uncond_prob", type=float, default=0.05)
    p.add_argument("--checkpointing_steps", type=int, default=1000)
    p.add_argument("--resume_from_checkpoint", default=None)
    p.add_argument("--eval_steps", type=int, default=1000)
    p.add_argument("--num_eval_prompts", type=int, default=256)
    p.add_argument("--clip_model", default="openai/clip-vit-large-patch14")
    p.add_argument("--report_to", default="tensorboard")
    p.add_argument("--seed", type=int, default=1337)
    return p.parse_args()


def main():
    args = parse_args()
    accelerator = Accelerator(
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        log_with=args.report_to,
        project_config=ProjectConfiguration(project_dir=args.output_dir, logging_dir=os.path.join(args.output_dir, "logs")),
    )
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", level=logging.INFO)
    logger.info(accelerator.state, main_process_only=False)
    set_seed(args.seed, device_specific=True)

    tokenizer = CLIPTokenizer.from_pretrained(args.pretrained_model, subfolder="tokenizer")
    text_encoder = CLIPTextModel.from_pretrained(args.pretrained_model, subfolder="text_encoder")
    vae = AutoencoderKL.from_pretrained(args.pretrained_model, subfolder="vae")
    unet = UNet2DConditionModel.from_pretrained(args.pretrained_model, subfolder="unet")
    noise_scheduler = DDPMScheduler.from_pretrained(args.pretrained_model, subfolder="scheduler")
    for m in (vae, text_encoder, unet):
        m.requires_grad_(False)

    weight_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(accelerator.mixed_precision, torch.float32)
    unet.to(accelerator.device, dtype=weight_dtype)
    vae.to(accelerator.device, dtype=weight_dtype)
    text_encoder.to(accelerator.device, dtype=weight_dtype)

    unet.add_adapter(LoraConfig(r=args.rank, lora_alpha=args.rank, init_lora_weights="gaussian",
                                target_modules=["to_k", "to_q", "to_v", "to_out.0"]))
    cast_training_params(unet, dtype=torch.float32)
    lora_params = list(filter(lambda p: p.requires_grad, unet.parameters()))
    ema = EMAModel(lora_params, decay=0.999)

    if args.scale_lr:
        args.learning_rate *= args.gradient_accumulation_steps * args.train_batch_size * accelerator.num_processes
    optimizer = torch.optim.AdamW(lora_params, lr=args.learning_rate, weight_decay=1e-2)

    dataset = load_dataset(args.dataset_name, split="train")
    tf = transforms.Compose([
        transforms.Resize(args.resolution), transforms.CenterCrop(args.resolution),
        transforms.RandomHorizontalFlip(), transforms.ToTensor(), transforms.Normalize([0.5], [0.5]),
    ])

    def preprocess(examples):
        examples["pixel_values"] = [tf(img.convert("RGB")) for img in examples["image"]]
        examples["input_ids"] = tokenizer(examples["text"], max_length=tokenizer.model_max_length,
                                          padding="max_length", truncation=True, return_tensors="pt").input_ids
        return examples

    with accelerator.main_process_first():
        split = dataset.train_test_split(test_size=args.num_eval_prompts, seed=args.seed)
        train_ds = split["train"].with_transform(preprocess)
        eval_prompts = split["test"]["text"]

    def collate(batch):
        return {"pixel_values": torch.stack([b["pixel_values"] for b in batch]).float(),
                "input_ids": torch.stack([b["input_ids"] for b in batch])}

    train_dl = torch.utils.data.DataLoader(train_ds, batch_size=args.train_batch_size, shuffle=True,
                                           collate_fn=collate, num_workers=4, drop_last=True)
    # the prepared scheduler is stepped once per process, so scale the step counts accordingly
    lr_scheduler = get_scheduler("cosine", optimizer,
                                 num_warmup_steps=args.lr_warmup_steps * accelerator.num_processes,
                                 num_training_steps=args.max_train_steps * accelerator.num_processes)
    unet, optimizer, train_dl, lr_scheduler = accelerator.prepare(unet, optimizer, train_dl, lr_scheduler)
    ema.to(accelerator.device)

    accelerator.init_trackers("sd15-lora", config=vars(args))

    with torch.no_grad():
        null_ids = tokenizer([""], padding="max_length", max_length=tokenizer.model_max_length,
                             return_tensors="pt").input_ids.to(accelerator.device)
        null_emb = text_encoder(null_ids)[0]

    clip_model = CLIPModel.from_pretrained(args.clip_model).to(accelerator.device).eval()
    clip_proc = CLIPProcessor.from_pretrained(args.clip_model)

    @torch.no_grad()
    def clip_score_eval(step):
        pipe = StableDiffusionPipeline.from_pretrained(
            args.pretrained_model, unet=accelerator.unwrap_model(unet), vae=vae, text_encoder=text_encoder,
            tokenizer=tokenizer, safety_checker=None, torch_dtype=weight_dtype)
        pipe.to(accelerator.device)
        pipe.set_progress_bar_config(disable=True)
        gen = torch.Generator(accelerator.device).manual_seed(args.seed + accelerator.process_index)
        scores = []
        # uneven split is fine here: the per-process lists are gathered as objects
        with accelerator.split_between_processes(eval_prompts) as my_prompts:
            for i in range(0, len(my_prompts), 8):
                chunk = my_prompts[i:i + 8]
                with torch.autocast("cuda", dtype=weight_dtype):
                    imgs = pipe(chunk, num_inference_steps=25, guidance_scale=7.5, generator=gen).images
                inp = clip_proc(text=chunk, images=imgs, return_tensors="pt", padding=True, truncation=True)
                out = clip_model(**{k: v.to(accelerator.device) for k, v in inp.items()})
                img_e = F.normalize(out.image_embeds, dim=-1)
                txt_e = F.normalize(out.text_embeds, dim=-1)
                scores.extend((100 * (img_e * txt_e).sum(-1)).clamp(min=0).tolist())
        scores = gather_object(scores)
        clip_score = sum(scores) / len(scores)
        accelerator.log({"eval/clip_score": clip_score}, step=step)
        logger.info("step %d CLIP score %.3f over %d prompts", step, clip_score, len(scores))
        del pipe
        torch.cuda.empty_cache()

    global_step = 0
    if args.resume_from_checkpoint:
        accelerator.load_state(args.resume_from_checkpoint)
        ema.load_state_dict(torch.load(os.path.join(args.resume_from_checkpoint, "ema_lora.pt"), map_location="cpu"))
        global_step = int(os.path.basename(args.resume_from_checkpoint.rstrip("/")).split("-")[-1])

    num_update_steps_per_epoch = math.ceil(len(train_dl) / args.gradient_accumulation_steps)
    num_epochs = math.ceil(args.max_train_steps / num_update_steps_per_epoch)
    first_epoch = global_step // num_update_steps_per_epoch
    progress = tqdm(range(args.max_train_steps), initial=global_step, disable=not accelerator.is_local_main_process)

    for epoch in range(first_epoch, num_epochs):
        unet.train()
        for batch in train_dl:
            with accelerator.accumulate(unet):
                latents = vae.encode(batch["pixel_values"].to(weight_dtype)).latent_dist.sample()
                latents = latents * vae.config.scaling_factor
                with torch.no_grad():
                    cond = text_encoder(batch["input_ids"])[0]
                drop = torch.rand(cond.shape[0], 1, 1, device=cond.device) < args.uncond_prob
                cond = torch.where(drop, null_emb, cond)
                noise = torch.randn_like(latents)
                t = torch.randint(0, noise_scheduler.config.num_train_timesteps, (latents.shape[0],),
                                  device=latents.device).long()
                noisy = noise_scheduler.add_noise(latents, noise, t)
                with accelerator.autocast():
                    pred = unet(noisy, t, cond).sample
                loss = F.mse_loss(pred.float(), noise.float())
                avg_loss = accelerator.gather(loss.detach().repeat(args.train_batch_size)).mean()
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(lora_params, 1.0)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()

            if accelerator.sync_gradients:
                ema.step(lora_params)
                global_step += 1
                progress.update(1)
                accelerator.log({"train/loss": avg_loss.item(), "lr": lr_scheduler.get_last_lr()[0]}, step=global_step)

                if global_step % args.checkpointing_steps == 0:
                    save_path = os.path.join(args.output_dir, f"checkpoint-{global_step}")
                    accelerator.save_state(save_path)
                    if accelerator.is_main_process:
                        torch.save(ema.state_dict(), os.path.join(save_path, "ema_lora.pt"))
                    accelerator.wait_for_everyone()

                if global_step % args.eval_steps == 0:
                    ema.store(lora_params)
                    ema.copy_to(lora_params)
                    clip_score_eval(global_step)
                    ema.restore(lora_params)

            if global_step >= args.max_train_steps:
                break

    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        ema.copy_to(lora_params)
        lora_sd = convert_state_dict_to_diffusers(get_peft_model_state_dict(accelerator.unwrap_model(unet)))
        StableDiffusionPipeline.save_lora_weights(args.output_dir, unet_lora_layers=lora_sd)
    accelerator.end_training()


if __name__ == "__main__":
    main()
