# The torch version the project is pinned to (requirements.txt), checked
# against the torch that find_package(Torch) found when that torch came from
# pip: another version is an error that names both and the fix.
file(STRINGS "${PROJECT_SOURCE_DIR}/requirements.txt" _hp_pin REGEX "^torch==")
string(REGEX REPLACE "^torch==" "" HP_TORCH_PINNED "${_hp_pin}")
if(HP_TORCH_FROM_PIP AND NOT HP_TORCH_PINNED STREQUAL "")
  # Torch_VERSION is e.g. 2.11.0 (a +cu130 local part is not in it).
  string(REGEX MATCH "^[0-9]+\\.[0-9]+\\.[0-9]+" _hp_found "${Torch_VERSION}")
  if(NOT _hp_found STREQUAL HP_TORCH_PINNED)
    message(FATAL_ERROR
      "hyperparallel is pinned to torch ${HP_TORCH_PINNED} (requirements.txt), but the torch "
      "found in ${TORCH_INSTALL_PREFIX} is ${Torch_VERSION}. Install the pinned one "
      "(pip install torch==${HP_TORCH_PINNED}, or bash scripts/setup_python.sh for the "
      "project's .venv), or change the pin in requirements.txt and test again.")
  endif()
endif()
