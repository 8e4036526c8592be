#include "tools/hp/commands.h"
namespace hp::cli { void add_schedule_command(CLI::App& app) { app.add_subcommand("schedule", "x"); } }
