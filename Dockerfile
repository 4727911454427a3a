# Hugging Face Space (Docker SDK) style: port 7860, uid 1000. Caches go to the persistent /data volume when one is
# mounted and writable, else to ~/.cache/acceldemo (the app logs which at start; ACCELDEMO_CACHE_DIR overrides both).
# CPU by default; accelerator hosts: --build-arg REQUIREMENTS=requirements-cuda.txt | -tpu.txt | -neuron.txt
FROM python:3.11-slim
ARG REQUIREMENTS=requirements.txt
RUN useradd -m -u 1000 user
USER user
ENV HOME=/home/user PATH=/home/user/.local/bin:$PATH \
    ACCELDEMO_HOST=0.0.0.0 PORT=7860 \
    GRADIO_ANALYTICS_ENABLED=False HF_HUB_OFFLINE=1
WORKDIR /home/user/app
COPY --chown=user requirements*.txt ./
RUN pip install --no-cache-dir --user -r ${REQUIREMENTS}
COPY --chown=user . .
EXPOSE 7860
# The first start may compile before it answers: give it time before failures count.
HEALTHCHECK --interval=30s --timeout=10s --start-period=300s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:7860/health', timeout=5)"]
CMD ["python", "app.py"]
