# Hugging Face Space (Docker SDK) style: port 7860, uid 1000, caches on the persistent /data volume.
# CPU by default; accelerator hosts: --build-arg REQUIREMENTS=requirements-cuda.txt | -tpu.txt | -neuron.txt
FROM python:3.11-slim
ARG REQUIREMENTS=requirements.txt
RUN useradd -m -u 1000 user
USER user
ENV HOME=/home/user PATH=/home/user/.local/bin:$PATH \
    ACCELDEMO_HOST=0.0.0.0 PORT=7860 ACCELDEMO_CACHE_DIR=/data/acceldemo \
    GRADIO_ANALYTICS_ENABLED=False HF_HUB_OFFLINE=1
WORKDIR /home/user/app
COPY --chown=user requirements*.txt ./
RUN pip install --no-cache-dir --user -r ${REQUIREMENTS}
COPY --chown=user . .
EXPOSE 7860
CMD ["python", "app.py"]
